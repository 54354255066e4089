"""Hand a vitcore ViT to timm: a folder in the layout of a timm model on the Hugging Face hub.

:func:`export_timm` writes ``model.safetensors`` (timm's tensor names) and ``config.json``
(``architecture``, ``num_classes``, ``model_args``, ``label_names``, ``pretrained_cfg``), which
``timm.create_model('local-dir:DIR', pretrained=True)`` loads (timm 1.0). The export either gives
timm's ``VisionTransformer`` the arguments and tensors that compute the same logits, or refuses in
one line that names what timm cannot represent; it never drops a layer.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from .checkpoint import LABELS_KEY, check_checkpoint, read_checkpoint
from .model import ViTConfig
from .posembed import sincos_2d

TIMM_CONFIG = "config.json"
TIMM_WEIGHTS = "model.safetensors"
# save_checkpoint(extra_metadata=...) key under which a model file may carry its class names, in
# head order, as a JSON list (the name the MLflow model's metadata uses).
# The timm constructor the config names. Every structural argument is in model_args, so this
# only picks the closest name a reader recognises; it changes nothing that is computed.
ARCHITECTURES = {"Ti": "vit_tiny_patch16_224", "S": "vit_small_patch16_224", "B": "vit_base_patch16_224",
                  "L": "vit_large_patch16_224", "H": "vit_huge_patch14_224"}
DEFAULT_ARCHITECTURE = "vit_base_patch16_224"
_PAPER = "An Image is Worth 16x16 Words: Transformers for Image Recognition at Scale"


class TimmExportError(ValueError):
    """An input the export cannot use; ``input`` names it ('model', 'output' or 'label_map')."""

    def __init__(self, input: str, message: str) -> None:
        super().__init__(message)
        self.input = input


@dataclass
class TimmExport:
    """What :func:`export_timm` wrote."""

    output: str
    architecture: str
    num_classes: int
    label_names: str  # where they came from: 'the model file', the --label-map file, or 'generic'


def refusal(config: ViTConfig) -> str | None:
    """Why timm's VisionTransformer cannot compute what ``config``'s model computes; None if it can."""
    if not isinstance(config, ViTConfig):
        return (f"{getattr(config, 'variant', type(config).__name__)} is not a Vision Transformer; the export "
                "writes timm's VisionTransformer only (a BiT ResNet's state dict already uses timm's resnetv2 "
                "names: load it with timm.create_model('resnetv2_...').load_state_dict)")
    if config.representation_size:
        return (f"its tanh pre-logits layer (representation_size={config.representation_size}, the pre-training "
                "head) has no counterpart in timm's VisionTransformer, and leaving it out changes every output; "
                "fine-tune the model first (jobs/finetune.py replaces it with one linear head) and export that")
    if config.resnet_layers is not None:
        return (f"{config.variant} is a hybrid; timm's hybrid ViTs use its own ResNetV2 stem, whose weight "
                "standardisation differs from vitcore's, so the logits would differ; export a plain ViT")
    if config.posemb == "relative":
        return ("its relative position attention (posemb='relative', Appendix D.4) has no counterpart in timm's "
                "VisionTransformer; export a model with learned, sin-cos, 2d or no position embeddings")
    if _mlp_ratio(config) is None:
        return (f"its MLP size {config.mlp_dim} is not int(width * mlp_ratio) for any float mlp_ratio at width "
                f"{config.width}, which is how timm sizes it")
    return None


def _mlp_ratio(config: ViTConfig) -> float | None:
    # timm sizes the MLP as int(dim * mlp_ratio): a ratio that rounds down would lose a unit.
    ratio = config.mlp_dim / config.width
    for candidate in (ratio, math.nextafter(ratio, math.inf)):
        if int(config.width * candidate) == config.mlp_dim:
            return candidate
    return None


def timm_model_args(config: ViTConfig) -> dict:
    """The ``model_args`` that build timm's VisionTransformer computing what ``config``'s model computes."""
    token = config.classifier == "token"
    h, w = config.img_size
    return {
        "img_size": h if h == w else [h, w],
        "patch_size": config.patch_size,
        "in_chans": config.in_chans,
        "embed_dim": config.width,
        "depth": config.depth,
        "num_heads": config.num_heads,
        "mlp_ratio": _mlp_ratio(config),
        "class_token": token,
        "global_pool": "token" if token else "avg",
        # vit_jax applies the final LayerNorm to every token and pools after it; timm's default
        # for 'avg' pools first and normalises the pooled vector.
        "fc_norm": False,
        # [class] gets no position embedding with sin-cos (the table covers the patches only).
        "no_embed_class": config.posemb == "sincos2d",
        "pos_embed": "none" if config.posemb == "none" else "learn",
        # vitcore's 'tanh' is the official JAX code's approximate GELU; 'erf' is nn.GELU's exact one.
        "act_layer": "gelu_tanh" if config.gelu == "tanh" else "gelu",
    }


def timm_state_dict(config: ViTConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vitcore's tensors under timm's names (the same, by design) with the position embedding that
    timm stores as one learned table: the sin-cos table written out, the 2d axis tables expanded."""
    out = {k: v.contiguous() for k, v in state_dict.items() if not k.startswith("pos_embed_2d.")}
    if config.posemb == "sincos2d":
        out["pos_embed"] = sincos_2d(config.grid, config.width)[None].to(state_dict["norm.weight"].dtype)
    elif config.posemb == "2d":
        gh, gw = config.grid
        y = state_dict["pos_embed_2d.pos_embed_y"][:, None].expand(gh, gw, -1)
        x = state_dict["pos_embed_2d.pos_embed_x"][None].expand(gh, gw, -1)
        table = torch.cat([y, x], dim=-1).reshape(1, gh * gw, -1)
        cls = state_dict.get("pos_embed_2d.pos_embed_cls")
        out["pos_embed"] = (table if cls is None else torch.cat([cls, table], dim=1)).contiguous()
    return out


def timm_pretrained_cfg(config: ViTConfig) -> dict:
    """The eval input vitscale trains and tests with (training/data.py): resize each side to the
    model's size (bilinear, aspect not kept: timm's 'squash'), no crop, then (x - 127.5) / 127.5."""
    c, (h, w) = config.in_chans, config.img_size
    return {
        "input_size": [c, h, w],
        "fixed_input_size": True,
        "interpolation": "bilinear",
        "crop_pct": 1.0,
        "crop_mode": "squash",
        "mean": [0.5] * c,
        "std": [0.5] * c,
        "num_classes": config.num_classes,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "paper_name": _PAPER,
        "paper_ids": "arXiv:2010.11929",
    }


def read_label_map(path: str | os.PathLike) -> list[str]:
    """Class names in head order from ``path``, in the forms jobs/prepare.py's --label-map takes: a JSON
    ``{"name": id}``, a JSON list of names, or a text file of one name a line (blank lines skipped)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TimmExportError("label_map", f"{path}: cannot be read ({e.__class__.__name__}: {e}); pass a text "
                              "file of class names, one a line, or a JSON list") from None
    if not (path.endswith(".json") or text.lstrip()[:1] in ("[", "{")):
        return _check_names([line.strip() for line in text.splitlines() if line.strip()], path, "label_map")
    try:
        names = json.loads(text)
    except json.JSONDecodeError as e:
        raise TimmExportError("label_map", f"{path}: not valid JSON ({e}); write the class names as "
                              '["cat", "dog", ...], {"cat": 0, "dog": 1, ...} or one a line') from None
    if isinstance(names, dict):
        ids = list(names.values())
        if not all(type(v) is int for v in ids) or sorted(ids) != list(range(len(ids))):
            raise TimmExportError("label_map", f"{path}: the ids of a {{name: id}} map must be 0..{len(names) - 1}, "
                                  "each once (one name per head output)")
        names = sorted(names, key=names.get)
    return _check_names(names, path, "label_map")


def _check_names(names, source: str, input: str) -> list[str]:
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise TimmExportError(input, f"{source}: class names must be non-empty strings, in head order; "
                              f"got {str(names)[:80]}")
    names = [n.strip() for n in names]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise TimmExportError(input, f"{source}: the class name {dup!r} appears twice; each head output needs "
                              "its own name")
    return names


def _label_names(config: ViTConfig, metadata: dict[str, str], model: str,
                 label_map: str | os.PathLike | None) -> tuple[list[str], str]:
    """(names, where they came from): ``label_map``, else the model file's metadata, else generic."""
    k = config.num_classes
    if label_map is not None:
        input, where = "label_map", os.fspath(label_map)
        if k == 0:
            raise TimmExportError(input, f"{where}: {model} has no classification head (num_classes=0), so it "
                                  "has no classes to name; leave out --label-map")
        names, source = read_label_map(where), where
    elif metadata.get(LABELS_KEY, "[]") != "[]":
        input, where = "model", f"{model} (metadata {LABELS_KEY!r})"
        try:
            names = json.loads(metadata[LABELS_KEY])
        except json.JSONDecodeError:
            names = None
        names, source = _check_names(names, where, input), "the model file"
    else:
        return [f"class_{i}" for i in range(k)], "generic"
    if len(names) != k:
        raise TimmExportError(input, f"{where}: {len(names)} class names for a head of {k} outputs; give exactly "
                              "one name per output, in head order")
    return names, source


def _check_output(output: str) -> None:
    if os.path.isdir(output):
        if os.listdir(output):
            raise TimmExportError("output", f"{output}: the folder is not empty; pass a new or empty folder "
                                  "(an export never overwrites)")
    elif os.path.exists(output):
        raise TimmExportError("output", f"{output}: is a file; pass a new or empty folder")


def export_timm(model: str | os.PathLike, output: str | os.PathLike, *,
                label_map: str | os.PathLike | None = None) -> TimmExport:
    """Write the vitcore checkpoint ``model`` as a timm model folder ``output`` (new or empty).

    Class names come from ``label_map`` (a file), else from the model file's ``labels`` metadata,
    else are generic (``class_0``...). Raises FileNotFoundError or CheckpointMismatch for a bad
    model file and :class:`TimmExportError` for anything else the export cannot use.
    """
    model, output = os.fspath(model), os.fspath(output)
    config = check_checkpoint(model)
    why = refusal(config)
    if why is not None:
        raise TimmExportError("model", f"{model}: cannot be exported to timm: {why}")
    _check_output(output)
    config, sd, metadata = read_checkpoint(model)
    names, source = _label_names(config, metadata, model, label_map)
    architecture = ARCHITECTURES.get(config.variant.split("/")[0], DEFAULT_ARCHITECTURE)
    hub_config = {"architecture": architecture, "num_classes": config.num_classes,
                  "num_features": config.width, "global_pool": "token" if config.classifier == "token" else "avg",
                  "model_args": timm_model_args(config), "pretrained_cfg": timm_pretrained_cfg(config)}
    if names:
        hub_config["label_names"] = names
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{os.path.basename(os.path.abspath(output))}.partial-{uuid.uuid4().hex[:8]}")
    os.mkdir(staging)
    try:
        save_file(timm_state_dict(config, sd), os.path.join(staging, TIMM_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(staging, TIMM_CONFIG), "w", encoding="utf-8") as f:
            json.dump(hub_config, f, indent=2)
            f.write("\n")
        if os.path.isdir(output):
            os.rmdir(output)  # empty, checked above
        os.replace(staging, output)  # never a half-written folder under the final name
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return TimmExport(output=output, architecture=architecture, num_classes=config.num_classes,
                      label_names=source)
