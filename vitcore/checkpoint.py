"""Our own checkpoints: one safetensors file whose metadata holds the model config as
JSON, so a pre-training job can hand a model to a fine-tuning job on another machine.
The metadata's `architecture` says which model the config describes ("vit" when absent,
as in files written before BiT ResNets joined)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open, save_file

from .convert import LoadReport, load_adapted
from .convert_bit import load_resnet_state_dict
from .model import VisionTransformer, ViTConfig
from .resnet import BiTConfig, ResNetV2

FORMAT = "vitcore/1"
# A stage saves its model under this name in its output folder; the next stage looks for it there.
MODEL_FILE = "model.safetensors"
# metadata "architecture" -> (config class, model class)
ARCHITECTURES = {"vit": (ViTConfig, VisionTransformer), "bit": (BiTConfig, ResNetV2)}


class CheckpointMismatch(ValueError):
    """A checkpoint file that is readable but not what it says it is (its config and tensors disagree)."""


#: The metadata key of a model's class names: a JSON list in head order.
LABELS_KEY = "labels"


def label_metadata(label_names: list[str] | None) -> dict[str, str] | None:
    """The metadata naming a model's classes, or None when it has none (MPP, an unlabelled set)."""
    return {LABELS_KEY: json.dumps(list(label_names))} if label_names else None


def save_checkpoint(model: VisionTransformer | ResNetV2, path: str | os.PathLike,
                    extra_metadata: dict[str, str] | None = None) -> None:
    """Write the model's weights and config to `path` (a `.safetensors` file)."""
    if not isinstance(model, (VisionTransformer, ResNetV2)):
        raise TypeError(f"save_checkpoint expects a vitcore VisionTransformer or ResNetV2, got {type(model).__name__}; "
                        f"for a MaskedPatchPrediction wrapper save its .backbone")
    path = os.fspath(path)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    metadata = {"format": FORMAT, "architecture": _architecture(model.config), "config": json.dumps(model.config.to_dict())}
    metadata.update(extra_metadata or {})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, path)  # never leave a half-written checkpoint under the final name


def _rough_params(config: ViTConfig | BiTConfig) -> int:
    """A lower bound on the parameters of ``config``'s encoder blocks (qkv, proj, MLP), or of a
    ResNet's 3x3 convs, from numbers alone."""
    if isinstance(config, BiTConfig):
        return sum(n * 9 * (config.width * 2 ** i) ** 2 for i, n in enumerate(config.layers))
    return config.depth * (4 * config.width * config.width + 2 * config.width * config.mlp_dim)


def _architecture(config: ViTConfig | BiTConfig) -> str:
    return "bit" if isinstance(config, BiTConfig) else "vit"


def _size_words(config: ViTConfig | BiTConfig) -> str:
    if isinstance(config, BiTConfig):
        return f"{config.variant}, layers {config.layers}, width {config.width}"
    return f"{config.variant}, width {config.width}, depth {config.depth}"


def _check_tensors_match_config(path: str, config: ViTConfig | BiTConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse a file whose tensors are not exactly those of the model its config describes.

    Before any model is built for real: a 556-byte file whose config says width 2048 would
    otherwise allocate gigabytes of randomly initialised weights and run on them. The rough
    count goes first so that an absurd config never gets as far as the shape check, which
    builds the model on the meta device (shapes only, no memory).
    """
    held = sum(math.prod(s) for s in shapes.values())
    rough = _rough_params(config)
    if rough > 2 * held + 1_000_000:
        raise CheckpointMismatch(f"{path}: its config ({_size_words(config)}) needs "
                         f"at least {rough:,} parameters but the file holds {held:,} in {len(shapes)} tensors; "
                         "the file is damaged or not a vitcore checkpoint, re-save it with vitcore.save_checkpoint")
    with torch.device("meta"):
        model = ARCHITECTURES[_architecture(config)][1](config)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    wrong = sorted(k for k in set(expected) & set(shapes) if expected[k] != shapes[k])
    if missing or extra or wrong:
        parts = [f"{len(missing)} missing (e.g. {missing[0]})" if missing else "",
                 f"{len(extra)} not in the model (e.g. {extra[0]})" if extra else "",
                 f"{len(wrong)} of another shape (e.g. {wrong[0]}: {shapes[wrong[0]]}, config gives "
                 f"{expected[wrong[0]]})" if wrong else ""]
        raise CheckpointMismatch(f"{path}: its tensors do not match its config ({config.variant}): "
                         + ", ".join(p for p in parts if p)
                         + "; the file is damaged or not a vitcore checkpoint, re-save it with vitcore.save_checkpoint")


def read_checkpoint(path: str | os.PathLike) -> tuple[ViTConfig | BiTConfig, dict[str, torch.Tensor], dict[str, str]]:
    """Return (config, state dict, metadata) of a checkpoint written by save_checkpoint.

    The tensors must be exactly those of the model the config describes (names and
    shapes); this is checked from the file's header before any tensor is read.
    """
    return _open_checked(path, read_tensors=True)


def check_checkpoint(path: str | os.PathLike) -> ViTConfig | BiTConfig:
    """The config of the checkpoint at ``path``, checked as :func:`read_checkpoint` checks it but
    from the header alone: no tensor is read, so a stage can vet its input before it starts work.
    Raises FileNotFoundError or CheckpointMismatch."""
    return _open_checked(path, read_tensors=False)[0]


def _open_checked(path: str | os.PathLike, *, read_tensors: bool):
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint; write one with vitcore.save_checkpoint")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != FORMAT or "config" not in metadata:
                raise CheckpointMismatch(f"{path}: safetensors file without a vitcore config (format "
                                 f"{metadata.get('format')!r}); for timm weights use vitcore.load_timm_state_dict")
            architecture = metadata.get("architecture", "vit")
            if architecture not in ARCHITECTURES:
                raise CheckpointMismatch(f"{path}: architecture {architecture!r} is not one vitcore builds "
                                         f"({', '.join(ARCHITECTURES)}); load it with the vitcore that wrote it")
            try:
                config = ARCHITECTURES[architecture][0].from_dict(json.loads(metadata["config"]))
            except (json.JSONDecodeError, TypeError, ValueError, KeyError) as e:
                raise CheckpointMismatch(f"{path}: its vitcore config cannot be read ({e}); re-save it with "
                                 "vitcore.save_checkpoint") from None
            _check_tensors_match_config(path, config, {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
            sd = {k: f.get_tensor(k) for k in f.keys()} if read_tensors else {}
    except CheckpointMismatch:
        raise
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointMismatch(f"{path}: not a readable safetensors checkpoint ({e}); re-save it") from e
    return config, sd, metadata


def load_checkpoint(path: str | os.PathLike, **overrides: Any) -> VisionTransformer | ResNetV2:
    """Rebuild the saved model. `overrides` change config fields before the weights are
    copied in, e.g. img_size=384 to fine-tune at a higher resolution (the position
    embeddings are interpolated) or num_classes=10 (a mismatched head stays zero)."""
    config, sd, _ = read_checkpoint(path)
    fields = config.to_dict()
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"load_checkpoint({os.fspath(path)!r}): unknown override(s) {unknown}; "
                         f"config fields are {', '.join(fields)}")
    fields.update(overrides)
    report = LoadReport(source=os.fspath(path))
    if isinstance(config, BiTConfig):
        model = ResNetV2(BiTConfig.from_dict(fields))
        load_resnet_state_dict(model, sd, report)
    else:
        model = VisionTransformer(ViTConfig.from_dict(fields))
        load_adapted(model, sd, pos_prefix=config.num_prefix_tokens, report=report, old_grid=config.grid)
    model.load_report = report
    return model
