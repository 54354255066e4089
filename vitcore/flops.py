"""Analytic compute per image, counted from shapes: multiply-accumulates of every conv,
dense layer and attention matmul (norms, softmax, pooling and activations are left out, as
is usual; they are well under 1% for ViT). ViT-B/16 at 224 px comes to about 17.6 GMACs.
BiT ResNets are counted the same way, convolutions and the head.
"""

from __future__ import annotations

import math

from .model import VisionTransformer, ViTConfig
from .resnet import BiTConfig, ResNetV2
from .variants import decode_bit_variant, decode_variant, is_bit_variant, resnet_stride

# Dense bf16 peaks in FLOP/s, for model FLOP utilisation (MFU).
BF16_PEAK_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,  # also H100 HBM3 / "H100 80GB HBM3"
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "A100": 312e12,
}


def bf16_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak for a CUDA device name, or None when unknown."""
    name = device_name.upper()
    if "H200" in name:
        return BF16_PEAK_FLOPS["H200"]
    if "H100" in name:
        if "PCIE" in name:
            return BF16_PEAK_FLOPS["H100 PCIe"]
        if "NVL" in name:
            return BF16_PEAK_FLOPS["H100 NVL"]
        return BF16_PEAK_FLOPS["H100 SXM"]
    if "A100" in name:
        return BF16_PEAK_FLOPS["A100"]
    return None


def _resnet_macs(layers: tuple[int, ...], in_chans: int, h: int, w: int, width: int = 64) -> tuple[int, int, int, int]:
    """MACs of a BiT ResNet body (root and stages; the hybrid's stem, or a BiT baseline without
    its head); returns (macs, out_h, out_w, out_channels)."""
    h, w = math.ceil(h / 2), math.ceil(w / 2)  # 7x7 stride-2 root conv, 'SAME'
    macs = h * w * width * in_chans * 49
    h, w = math.ceil(h / 2), math.ceil(w / 2)  # 3x3 stride-2 max-pool
    in_ch = width
    for i, depth in enumerate(layers):
        f = width * 2 ** i
        for u in range(depth):
            stride = 2 if (i > 0 and u == 0) else 1
            oh, ow = math.ceil(h / stride), math.ceil(w / stride)
            macs += h * w * f * in_ch  # conv1 1x1 at the input resolution
            macs += oh * ow * f * f * 9  # conv2 3x3 carries the stride
            macs += oh * ow * 4 * f * f  # conv3 1x1
            if in_ch != 4 * f or stride != 1:
                macs += oh * ow * 4 * f * in_ch  # projection shortcut
            h, w, in_ch = oh, ow, 4 * f
    return macs, h, w, in_ch


def _config_of(model_or_config, img_size, num_classes) -> ViTConfig | BiTConfig:
    """The config a count is taken for: a model's, a config, or a variant name's at 224 px and
    1,000 classes, with `img_size` and `num_classes` applied when given."""
    overrides = {k: v for k, v in (("img_size", img_size), ("num_classes", num_classes)) if v is not None}
    if isinstance(model_or_config, str):
        bit = is_bit_variant(model_or_config)
        spec = (decode_bit_variant if bit else decode_variant)(model_or_config)
        kind = BiTConfig if bit else ViTConfig
        return kind(variant=model_or_config, **{"img_size": 224, "num_classes": 1000, **overrides}, **spec)
    cfg = getattr(model_or_config, "config", model_or_config)
    if not isinstance(cfg, (ViTConfig, BiTConfig)):
        raise TypeError(f"count_macs expects a vitcore model, its config or a variant name, "
                        f"got {type(model_or_config).__name__}")
    return type(cfg).from_dict({**cfg.to_dict(), **overrides}) if overrides else cfg


def _vit_macs(cfg: ViTConfig) -> int:
    d, gh, gw = cfg.width, *cfg.grid
    n = gh * gw
    if cfg.resnet_layers is None:
        macs = n * d * cfg.in_chans * cfg.patch_size ** 2
    else:
        macs, fh, fw, ch = _resnet_macs(cfg.resnet_layers, cfg.in_chans, *cfg.img_size)
        k = cfg.patch_size // resnet_stride(cfg.resnet_layers)
        macs += n * d * ch * k * k
    seq = cfg.seq_len
    per_block = (seq * d * 3 * d  # qkv projection
                 + 2 * seq * seq * d  # q k^T and attention-weighted values
                 + seq * d * d  # output projection
                 + 2 * seq * d * cfg.mlp_dim)  # MLP
    if cfg.posemb == "relative":
        per_block += seq * (2 * seq - 1) * d  # queries against the offset table
    macs += cfg.depth * per_block
    rep = cfg.representation_size or d
    if cfg.representation_size:
        macs += d * rep
    macs += rep * cfg.num_classes
    return macs


def _bit_macs(cfg: BiTConfig) -> int:
    # BiT's symmetric padding gives the same output sizes as 'SAME' (ceil(size / stride)), and
    # its units have the hybrid's convolutions in another order, so the hybrid's count serves.
    macs, _, _, ch = _resnet_macs(cfg.layers, cfg.in_chans, *cfg.img_size, width=cfg.width)
    return macs + ch * cfg.num_classes


def count_macs(model_or_config: VisionTransformer | ResNetV2 | ViTConfig | BiTConfig | str,
               img_size: int | tuple[int, int] | None = None, num_classes: int | None = None) -> int:
    """Forward multiply-accumulates for one image."""
    cfg = _config_of(model_or_config, img_size, num_classes)
    return int(_bit_macs(cfg) if isinstance(cfg, BiTConfig) else _vit_macs(cfg))


def train_flops_per_image(model_or_config, img_size=None, num_classes=None) -> int:
    """FLOPs of one training step per image: 2 FLOPs per MAC, and the backward pass
    costs twice the forward (gradients for activations and for weights)."""
    return 3 * 2 * count_macs(model_or_config, img_size, num_classes)
