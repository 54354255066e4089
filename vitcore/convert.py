"""Load foreign weights into a `VisionTransformer` in place.

`load_npz` reads the official JAX checkpoints (vit_jax, including the R50 hybrids) and
big_vision's; `load_timm_state_dict` reads timm's `VisionTransformer`. Both go through
`load_adapted`, which also serves our own checkpoints: it re-grids the position
embeddings to the model's resolution (Section 3.2), leaves a head of the wrong shape
freshly initialised with a warning, and reports everything it did not load.
Given a BiT ResNet, both read its formats instead (the official BiT `.npz`, timm's
`resnetv2_*_bit`), through convert_bit.py.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

from .convert_bit import bit_npz_to_state_dict, is_bit_npz, load_resnet_state_dict, set_ws_eps
from .model import VisionTransformer, set_gelu
from .posembed import adapt_pos_embed, resize_1d
from .resnet import ResNetV2

_PREFIXES = ("opt/target/", "params/")
# Sub-module names inside one encoder block. Old Flax numbered modules with one shared
# counter (vit_jax); big_vision's Flax numbers each module type from zero.
_BLOCK_LAYOUTS = {
    "vit_jax": dict(ln1="LayerNorm_0", attn="MultiHeadDotProductAttention_1", ln2="LayerNorm_2",
                    mlp="MlpBlock_3"),
    "big_vision": dict(ln1="LayerNorm_0", attn="MultiHeadDotProductAttention_0", ln2="LayerNorm_1",
                       mlp="MlpBlock_0"),
}


@dataclass
class LoadReport:
    """What a loader did. `skipped` maps a model tensor left as initialised to why;
    `unused` lists checkpoint entries the model has no place for."""

    source: str
    loaded: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    resized: dict[str, str] = field(default_factory=dict)
    gelu: str | None = None

    def __str__(self) -> str:
        lines = [f"{self.source}: loaded {len(self.loaded)} tensors"]
        lines += [f"  resized {k}: {v}" for k, v in self.resized.items()]
        lines += [f"  skipped {k}: {v}" for k, v in self.skipped.items()]
        if self.unused:
            lines.append(f"  unused checkpoint entries: {', '.join(self.unused)}")
        if self.gelu:
            lines.append(f"  gelu set to {self.gelu!r}")
        return "\n".join(lines)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _conv(kernel: np.ndarray) -> torch.Tensor:
    # Flax kernels are HWIO; torch wants OIHW.
    return _t(kernel.transpose(3, 2, 0, 1))


def _dense(kernel: np.ndarray) -> torch.Tensor:
    # Flax Dense is x @ kernel with kernel (in, out); nn.Linear stores (out, in).
    return _t(kernel.T)


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a `.npz` checkpoint, stripping an `opt/target/` or `params/` prefix."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint; pass the path of a ViT .npz file")
    try:
        with np.load(path, allow_pickle=False) as f:
            raw = {k: f[k] for k in f.files}
    except Exception as e:  # zipfile/ValueError on corrupt input
        raise ValueError(f"{path}: not a readable .npz checkpoint ({e}); re-download or re-export it") from e
    if not raw:
        raise ValueError(f"{path}: the .npz holds no arrays; it is not a ViT checkpoint")
    return _strip(raw)


def _strip(raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in raw.items():
        for p in _PREFIXES:
            if k.startswith(p):
                k = k[len(p):]
                break
        out[k] = np.asarray(v)
    return out


def _unstack_scanned(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """big_vision's scan layout stacks all blocks under `Transformer/encoderblock/` with a
    leading depth axis; split it into `encoderblock_i`."""
    stacked = "Transformer/encoderblock/"
    if not any(k.startswith(stacked) for k in params):
        return params
    out = {}
    for k, v in params.items():
        if k.startswith(stacked):
            for i in range(v.shape[0]):
                out[f"Transformer/encoderblock_{i}/{k[len(stacked):]}"] = v[i]
        else:
            out[k] = v
    return out


def npz_to_state_dict(params: Mapping[str, np.ndarray], *, source: str = "npz"
                      ) -> tuple[dict[str, torch.Tensor], int, list[str], str]:
    """Translate official/big_vision parameter names and layouts to our (timm) names.

    Returns (state_dict, number of class slots in its position embedding, unused keys,
    layout name). Every reshape/transpose is spelled out; shapes in comments are B/16's.
    """
    p = _unstack_scanned(_strip(params))
    used: set[str] = set()

    def take(key: str) -> np.ndarray:
        used.add(key)
        return p[key]

    if "embedding/kernel" not in p:
        raise ValueError(f"{source}: no 'embedding/kernel' entry; keys start with "
                         f"{sorted(p)[:5]}; this is not a ViT checkpoint in the vit_jax or big_vision layout")
    block0 = "Transformer/encoderblock_0/"
    layout = next((name for name, b in _BLOCK_LAYOUTS.items() if f"{block0}{b['attn']}/query/kernel" in p), None)
    if layout is None:
        raise ValueError(f"{source}: found no {block0}MultiHeadDotProductAttention_{{0,1}}/query/kernel; "
                         f"not a recognised ViT layout")
    names = _BLOCK_LAYOUTS[layout]
    sd: dict[str, torch.Tensor] = {
        "patch_embed.proj.weight": _conv(take("embedding/kernel")),  # (16,16,3,768) -> (768,3,16,16)
        "patch_embed.proj.bias": _t(take("embedding/bias")),
    }
    if "cls" in p:
        sd["cls_token"] = _t(take("cls"))  # (1,1,768)
    if "Transformer/posembed_input/pos_embedding" in p:
        # vit_jax adds E_pos after prepending [class], so a token model has N+1 rows.
        sd["pos_embed"] = _t(take("Transformer/posembed_input/pos_embedding"))
        pos_prefix = 1 if "cls" in p else 0
    elif "pos_embedding" in p:
        # big_vision adds E_pos before prepending [class]: N rows, no class slot.
        sd["pos_embed"] = _t(take("pos_embedding"))
        pos_prefix = 0
    else:
        pos_prefix = 0
    depth = 0
    while f"Transformer/encoderblock_{depth}/{names['attn']}/query/kernel" in p:
        depth += 1
    for i in range(depth):
        src, dst = f"Transformer/encoderblock_{i}/", f"blocks.{i}."
        att = src + names["attn"] + "/"
        for ours, theirs in (("norm1", names["ln1"]), ("norm2", names["ln2"])):
            sd[dst + ours + ".weight"] = _t(take(f"{src}{theirs}/scale"))
            sd[dst + ours + ".bias"] = _t(take(f"{src}{theirs}/bias"))
        qkv_w, qkv_b = [], []
        for part in ("query", "key", "value"):
            k = take(f"{att}{part}/kernel")  # (768, 12, 64): x @ k over d gives heads x hd
            qkv_w.append(k.reshape(k.shape[0], -1).T)  # -> (768 out = 12*64, 768 in)
            qkv_b.append(take(f"{att}{part}/bias").reshape(-1))  # (12, 64) -> (768,)
        sd[dst + "attn.qkv.weight"] = _t(np.concatenate(qkv_w, 0))  # (2304, 768)
        sd[dst + "attn.qkv.bias"] = _t(np.concatenate(qkv_b, 0))
        out = take(f"{att}out/kernel")  # (12, 64, 768): contracts heads and hd
        sd[dst + "attn.proj.weight"] = _t(out.reshape(-1, out.shape[-1]).T)  # -> (768, 768)
        sd[dst + "attn.proj.bias"] = _t(take(f"{att}out/bias"))
        for j, fc in ((0, "fc1"), (1, "fc2")):
            sd[f"{dst}mlp.{fc}.weight"] = _dense(take(f"{src}{names['mlp']}/Dense_{j}/kernel"))
            sd[f"{dst}mlp.{fc}.bias"] = _t(take(f"{src}{names['mlp']}/Dense_{j}/bias"))
    sd["norm.weight"] = _t(take("Transformer/encoder_norm/scale"))
    sd["norm.bias"] = _t(take("Transformer/encoder_norm/bias"))
    for theirs, ours in (("pre_logits", "pre_logits.fc"), ("head", "head")):
        if f"{theirs}/kernel" in p:
            sd[ours + ".weight"] = _dense(take(f"{theirs}/kernel"))
            sd[ours + ".bias"] = _t(take(f"{theirs}/bias"))
    sd.update(_hybrid_to_state_dict(p, used))
    unused = sorted(set(p) - used)
    return sd, pos_prefix, unused, layout


_HYBRID_KEY = re.compile(r"^block(\d+)/unit(\d+)/(conv\d|conv_proj|gn\d|gn_proj)/(kernel|scale|bias)$")


def _hybrid_to_state_dict(p: Mapping[str, np.ndarray], used: set[str]) -> dict[str, torch.Tensor]:
    """vit_jax's inline ResNet: conv_root/gn_root, then blockS/unitU/{conv,gn}{1,2,3,_proj}."""
    sd = {}
    root = "patch_embed.backbone."
    for key, arr in p.items():
        if key in ("conv_root/kernel", "gn_root/scale", "gn_root/bias"):
            ours = {"conv_root/kernel": "stem.conv.weight", "gn_root/scale": "stem.norm.weight",
                    "gn_root/bias": "stem.norm.bias"}[key]
        else:
            m = _HYBRID_KEY.match(key)
            if m is None:
                continue
            stage, unit, layer, kind = int(m[1]) - 1, int(m[2]) - 1, m[3], m[4]
            layer = {"conv_proj": "downsample.conv", "gn_proj": "downsample.norm"}.get(
                layer, layer.replace("gn", "norm"))
            ours = f"stages.{stage}.blocks.{unit}.{layer}.{'bias' if kind == 'bias' else 'weight'}"
        used.add(key)
        sd[root + ours] = _conv(arr) if key.endswith("kernel") else _t(arr)
    return sd


def _check_model(model) -> VisionTransformer | ResNetV2:
    if not isinstance(model, (VisionTransformer, ResNetV2)):
        raise TypeError(f"expected a vitcore VisionTransformer or ResNetV2, got {type(model).__name__}; "
                        f"for a MaskedPatchPrediction wrapper pass its .backbone")
    return model


def _load_bit_npz(model: ResNetV2, params: Mapping[str, np.ndarray], source: str) -> LoadReport:
    if not is_bit_npz(params):
        raise ValueError(f"{source}: no 'resnet/root_block/standardized_conv2d/kernel' entry; keys start with "
                         f"{sorted(params)[:5]}; this is not a BiT checkpoint, so it cannot load into "
                         f"{model.config.variant} (a ViT .npz loads into a ViT variant such as 'B/16')")
    sd, unused = bit_npz_to_state_dict(params)
    if unused:
        warnings.warn(f"{source}: checkpoint entries with no place in the model: {', '.join(unused)}", stacklevel=3)
    # The BiT code standardises kernels with epsilon 1e-10; the weights were trained with it.
    set_ws_eps(model, 1e-10)
    return load_resnet_state_dict(model, sd, LoadReport(source=f"{source} (BiT layout)", unused=list(unused)))


def load_adapted(model: VisionTransformer, sd: Mapping[str, torch.Tensor], *, pos_prefix: int,
                 report: LoadReport, old_grid: tuple[int, int] | None = None) -> LoadReport:
    """Copy a state dict in our naming into `model`, adapting what Section 3.2 allows
    (position grid, class slot, head) and refusing any other shape difference.

    `old_grid` is the checkpoint's patch grid; None means square (or the model's own
    grid when the row counts agree)."""
    cfg = model.config
    if cfg.posemb == "learn" and "pos_embed" not in sd:
        raise ValueError(f"{report.source}: no learned position embedding in the checkpoint (it was probably "
                         f"trained with fixed sin-cos or no position embeddings); build the model with "
                         f"posemb='sincos2d' or posemb='none' to match")
    own = model.state_dict()
    to_load: dict[str, torch.Tensor] = {}
    head_skipped: list[str] = []
    for name, value in sd.items():
        if name == "pos_embed":
            if cfg.posemb != "learn":
                report.skipped[name] = f"model uses posemb={cfg.posemb!r}; learned 1D embedding ignored"
                continue
            old = value.shape[-2] - pos_prefix
            grid = old_grid or (cfg.grid if old == cfg.grid[0] * cfg.grid[1] else None)
            new = adapt_pos_embed(value, new_grid=cfg.grid, new_prefix=cfg.num_prefix_tokens,
                                  old_prefix=pos_prefix, old_grid=grid)
            if old != cfg.grid[0] * cfg.grid[1] or (grid and tuple(grid) != cfg.grid):
                grid = grid or (math.isqrt(old),) * 2
                report.resized[name] = (f"grid {grid[0]}x{grid[1]} -> {cfg.grid[0]}x{cfg.grid[1]} "
                                        f"(bilinear, align_corners)")
            if pos_prefix == 0 and cfg.num_prefix_tokens:
                report.resized[name + ".class_slot"] = "checkpoint has no class slot; zero (same function)"
            value = new
        elif name.endswith(("rel_embed", "pos_embed_y", "pos_embed_x")) and name in own \
                and value.shape != own[name].shape:
            report.resized[name] = f"{value.shape[0]} -> {own[name].shape[0]} entries (linear, align_corners)"
            value = resize_1d(value, own[name].shape[0])
        if name.startswith(("head.", "pre_logits.")):
            if name not in own:
                report.skipped[name] = ("model has no pre-logits layer (fine-tuning head, Section 3.2)"
                                        if name.startswith("pre_logits.") else "model has no head")
                continue
            if value.shape != own[name].shape:
                head_skipped.append(f"{name}: checkpoint {tuple(value.shape)} vs model {tuple(own[name].shape)}")
                continue
        elif name == "cls_token" and name not in own:
            report.skipped[name] = "model uses gap pooling; [class] token dropped"
            continue
        elif name not in own:
            report.unused.append(name)
            continue
        if value.shape != own[name].shape:
            raise ValueError(
                f"{report.source}: {name} is {tuple(value.shape)} in the checkpoint but {tuple(own[name].shape)} "
                f"in {cfg.variant} (width {cfg.width}, depth {cfg.depth}, heads {cfg.num_heads}); "
                f"build the model with the checkpoint's variant")
        to_load[name] = value
    if head_skipped:
        warnings.warn(f"{report.source}: head shape does not match, left freshly initialised: "
                      + "; ".join(head_skipped), stacklevel=3)
        for h in head_skipped:
            report.skipped[h.split(":")[0]] = "shape mismatch" + h[h.index(":"):]
    missing = [k for k in own if k not in to_load and k not in report.skipped]
    body_missing = [k for k in missing if not k.startswith(("head.", "pre_logits."))]
    if body_missing:
        warnings.warn(f"{report.source}: not in the checkpoint, left as initialised: {', '.join(body_missing)}",
                      stacklevel=3)
    for k in missing:
        report.skipped[k] = "not in the checkpoint"
    model.load_state_dict(to_load, strict=False)
    report.loaded = sorted(to_load)
    return report


def load_npz(model: VisionTransformer | ResNetV2, path: str | os.PathLike | Mapping[str, np.ndarray]) -> LoadReport:
    """Load an official vit_jax or big_vision `.npz` (or its dict of arrays) in place; into a
    BiT ResNet, an official BiT `.npz`.

    Sets the GELU to the tanh approximation, which is what Flax's `nn.gelu` computes,
    so the model reproduces the JAX outputs.
    """
    model = _check_model(model)
    source = os.fspath(path) if isinstance(path, (str, os.PathLike)) else "npz params"
    params = read_npz(path) if isinstance(path, (str, os.PathLike)) else dict(path)
    if isinstance(model, ResNetV2):
        return _load_bit_npz(model, params, source)
    if is_bit_npz(params):
        raise ValueError(f"{source}: a BiT ResNet checkpoint; load it into a BiT variant such as 'BiT-R50x1', "
                         f"not {model.config.variant}")
    sd, pos_prefix, unused, layout = npz_to_state_dict(params, source=source)
    report = LoadReport(source=f"{source} ({layout} layout)", unused=list(unused))
    if unused:
        warnings.warn(f"{source}: checkpoint entries with no place in the model: {', '.join(unused)}",
                      stacklevel=2)
    set_gelu(model, "tanh")
    report.gelu = "tanh"
    return load_adapted(model, sd, pos_prefix=pos_prefix, report=report)


def load_timm_state_dict(model: VisionTransformer | ResNetV2, state_dict: Mapping[str, torch.Tensor]) -> LoadReport:
    """Load a timm `VisionTransformer` state dict in place; sets the exact erf GELU
    that timm uses. Into a BiT ResNet, loads a timm `resnetv2_*_bit` state dict and sets
    timm's weight-standardisation epsilon (1e-8)."""
    model = _check_model(model)
    sd = {k.removeprefix("module."): v for k, v in state_dict.items()}
    if isinstance(model, ResNetV2):
        set_ws_eps(model, 1e-8)
        return load_resnet_state_dict(model, sd, LoadReport(source="timm state dict"))
    if any(k.startswith("patch_embed.backbone.") for k in sd):
        raise ValueError("timm hybrid state dicts are not supported (timm's StdConv uses another epsilon); "
                         "load the official R50+ViT .npz with vitcore.load_npz instead")
    for key, why in (("fc_norm.weight", "normalises after global pooling (fc_norm)"),
                     ("reg_token", "has register tokens"),
                     ("attn_pool.latent", "uses attention pooling")):
        if key in sd:
            raise ValueError(f"timm state dict {why}, which the paper's ViT does not have; "
                             f"vitcore cannot reproduce it")
    pos_prefix = 0
    if "pos_embed" in sd and "cls_token" in sd:
        rows = sd["pos_embed"].shape[1]
        # timm's no_embed_class models store N rows and add them before [class].
        pos_prefix = 0 if math.isqrt(rows) ** 2 == rows else 1
    set_gelu(model, "erf")
    report = LoadReport(source="timm state dict", gelu="erf")
    return load_adapted(model, sd, pos_prefix=pos_prefix, report=report)
