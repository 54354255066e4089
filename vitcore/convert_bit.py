"""BiT ResNet weights: the official BiT `.npz` layout, and the state-dict loader that our own
checkpoints and timm's `resnetv2_*_bit` state dicts go through.

The official layout (big_transfer, also read by big_vision's bit_paper.py and timm) prefixes
every key with `resnet/`; conv kernels are HWIO and carry no bias:
`root_block/standardized_conv2d/kernel`, `block{s}/unit{uu}/{a,b,c}/standardized_conv2d/kernel`
and `.../{a,b,c}/group_norm/{gamma,beta}` (s from 1, uu two digits from 01), the projection
`block{s}/unit01/a/proj/standardized_conv2d/kernel`, the final `group_norm/{gamma,beta}`, and
`head/conv2d/{kernel,bias}`, a 1x1 conv. Units a, b, c are our norm1/conv1, norm2/conv2 and
norm3/conv3: each unit's GroupNorm comes before its conv (pre-activation).
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Mapping

import numpy as np
import torch

from .resnet import ResNetV2

_UNIT_KEY = re.compile(r"^block(\d+)/unit(\d+)/(a|b|c)/(proj/)?(standardized_conv2d|group_norm)/(kernel|gamma|beta)$")
_LAYER = {"a": "1", "b": "2", "c": "3"}
_ROOT = {"root_block/standardized_conv2d/kernel": "stem.conv.weight",
         "group_norm/gamma": "norm.weight", "group_norm/beta": "norm.bias",
         "head/conv2d/kernel": "head.fc.weight", "head/conv2d/bias": "head.fc.bias"}


def is_bit_npz(params: Mapping[str, np.ndarray]) -> bool:
    return any(k.startswith("resnet/") or k == "root_block/standardized_conv2d/kernel" for k in params)


def _ours(key: str) -> str | None:
    """Our (timm's) name for one official key, or None when the key has no place in a ResNetV2."""
    if key in _ROOT:
        return _ROOT[key]
    m = _UNIT_KEY.match(key)
    if m is None:
        return None
    stage, unit, layer, proj, kind, leaf = int(m[1]) - 1, int(m[2]) - 1, m[3], m[4], m[5], m[6]
    prefix = f"stages.{stage}.blocks.{unit}."
    if proj:
        return prefix + "downsample.conv.weight" if layer == "a" and kind == "standardized_conv2d" else None
    if kind == "standardized_conv2d":
        return prefix + f"conv{_LAYER[layer]}.weight"
    return prefix + f"norm{_LAYER[layer]}." + ("weight" if leaf == "gamma" else "bias")


def bit_npz_to_state_dict(params: Mapping[str, np.ndarray]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Translate the official BiT names and layouts to ours; returns (state dict, unused keys)."""
    sd, unused = {}, []
    for raw, value in params.items():
        # Some released files number the conv scope (`standardized_conv2d_1`); big_vision strips it too.
        key = re.sub(r"/standardized_conv2d_\d+/", "/standardized_conv2d/", raw.removeprefix("resnet/"))
        ours = _ours(key)
        if ours is None:
            unused.append(raw)
            continue
        a = np.asarray(value, dtype=np.float32)
        if key.endswith("/kernel"):
            a = a.transpose(3, 2, 0, 1)  # HWIO -> OIHW; the head's (1, 1, C, K) becomes (K, C, 1, 1)
        else:
            a = a.reshape(-1)  # GroupNorm scales were saved as (C,) or broadcast to (1, 1, 1, C)
        sd[ours] = torch.from_numpy(np.ascontiguousarray(a))
    return sd, sorted(unused)


def load_resnet_state_dict(model: ResNetV2, sd: Mapping[str, torch.Tensor], report: Any) -> Any:
    """Copy a state dict in our naming into `model`: a head of another shape stays freshly
    initialised (with a warning); any other shape difference is refused, naming the fix.
    Fills and returns `report`, a `convert.LoadReport` (not imported: convert imports this module)."""
    own = model.state_dict()
    to_load, head_skipped = {}, []
    for name, value in sd.items():
        if name not in own and name.startswith("head."):
            report.skipped[name] = "model has no head"
            continue
        if name not in own:
            report.unused.append(name)
            continue
        if value.shape != own[name].shape:
            if name.startswith("head."):
                head_skipped.append(f"{name}: checkpoint {tuple(value.shape)} vs model {tuple(own[name].shape)}")
                continue
            raise ValueError(f"{report.source}: {name} is {tuple(value.shape)} in the checkpoint but "
                             f"{tuple(own[name].shape)} in {model.config.variant} (layers {model.config.layers}, "
                             f"width {model.config.width}); build the model with the checkpoint's variant")
        to_load[name] = value
    if head_skipped:
        warnings.warn(f"{report.source}: head shape does not match, left freshly initialised: "
                      + "; ".join(head_skipped), stacklevel=3)
        for h in head_skipped:
            report.skipped[h.split(":")[0]] = "shape mismatch" + h[h.index(":"):]
    missing = [k for k in own if k not in to_load and k not in report.skipped]
    body_missing = [k for k in missing if not k.startswith("head.")]
    if body_missing:
        warnings.warn(f"{report.source}: not in the checkpoint, left as initialised: {', '.join(body_missing)}",
                      stacklevel=3)
    for k in missing:
        report.skipped[k] = "not in the checkpoint"
    model.load_state_dict(to_load, strict=False)
    report.loaded = sorted(to_load)
    return report


def set_ws_eps(model: ResNetV2, eps: float) -> None:
    """Set the weight-standardisation epsilon of every conv, to match where the weights came from."""
    for m in model.modules():
        if hasattr(m, "standardized_weight"):
            m.eps = eps
    model.config.ws_eps = eps
