"""Our own checkpoints: one safetensors file whose metadata holds the model config as
JSON, so a pre-training job can hand a model to a fine-tuning job on another machine."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open, save_file

from .convert import LoadReport, load_adapted
from .model import ViTConfig, VisionTransformer

FORMAT = "vitcore/1"
# A stage saves its model under this name in its output folder; the next stage looks for it there.
MODEL_FILE = "model.safetensors"


def save_checkpoint(model: VisionTransformer, path: str | os.PathLike,
                    extra_metadata: dict[str, str] | None = None) -> None:
    """Write the model's weights and config to `path` (a `.safetensors` file)."""
    if not isinstance(model, VisionTransformer):
        raise TypeError(f"save_checkpoint expects a vitcore VisionTransformer, got {type(model).__name__}; "
                        f"for a MaskedPatchPrediction wrapper save its .backbone")
    path = os.fspath(path)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    metadata = {"format": FORMAT, "config": json.dumps(model.config.to_dict())}
    metadata.update(extra_metadata or {})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, path)  # never leave a half-written checkpoint under the final name


def read_checkpoint(path: str | os.PathLike) -> tuple[ViTConfig, dict[str, torch.Tensor], dict[str, str]]:
    """Return (config, state dict, metadata) of a checkpoint written by save_checkpoint."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint; write one with vitcore.save_checkpoint")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable safetensors checkpoint ({e}); re-save it") from e
    if metadata.get("format") != FORMAT or "config" not in metadata:
        raise ValueError(f"{path}: safetensors file without a vitcore config (format "
                         f"{metadata.get('format')!r}); for timm weights use vitcore.load_timm_state_dict")
    return ViTConfig.from_dict(json.loads(metadata["config"])), sd, metadata


def load_checkpoint(path: str | os.PathLike, **overrides: Any) -> VisionTransformer:
    """Rebuild the saved model. `overrides` change config fields before the weights are
    copied in, e.g. img_size=384 to fine-tune at a higher resolution (the position
    embeddings are interpolated) or num_classes=10 (a mismatched head stays zero)."""
    config, sd, _ = read_checkpoint(path)
    saved_grid = config.grid
    fields = config.to_dict()
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"load_checkpoint({os.fspath(path)!r}): unknown override(s) {unknown}; "
                         f"config fields are {', '.join(fields)}")
    fields.update(overrides)
    model = VisionTransformer(ViTConfig.from_dict(fields))
    report = LoadReport(source=os.fspath(path))
    load_adapted(model, sd, pos_prefix=config.num_prefix_tokens, report=report, old_grid=saved_grid)
    model.load_report = report
    return model
