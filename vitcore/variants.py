"""The ViT variant table and the one function that decodes a name such as "B/16".

Widths, depths, MLP sizes and heads come from Table 1 of the paper (B, L, H) and from
the official code and big_vision for the smaller ones (mu, Ti, S, M). Hybrids are named
"R50+B/16": a BiT ResNet stem whose total stride is the named patch size, followed by
1x1 patches (Section 3.1, "Hybrid Architecture"). The paper's convolutional baselines are
named "BiT-R50x1": a BiT ResNetV2 of depth 50 and width factor 1 (Section 4.1, Table 6).
"""

from __future__ import annotations

import re
from typing import Any

# name: (width, depth, mlp_dim, num_heads)
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "mu": (32, 1, 128, 2),  # big_vision's smoke-test model
    "Ti": (192, 12, 768, 3),
    "S": (384, 12, 1536, 6),
    "M": (512, 12, 2048, 8),
    "B": (768, 12, 3072, 12),  # Table 1
    "L": (1024, 24, 4096, 16),  # Table 1
    "H": (1280, 32, 5120, 16),  # Table 1
}

# The paper's patch sizes; others are accepted (e.g. 4 for 32 px smoke tests).
PATCH_SIZES = (8, 14, 16, 32)

# ResNet stage depths of the hybrid stems, keyed by name and total stride. Each stage
# after the first halves the resolution; the root (conv stride 2 + pool stride 2) gives 4.
# Section 4.1: stride-16 hybrids drop ResNet-50's stage 4 and move its 3 units into an
# extended stage 3, keeping the total number of layers (3, 4, 6+3).
RESNET_STAGES: dict[str, dict[int, tuple[int, ...]]] = {
    "R50": {16: (3, 4, 9), 32: (3, 4, 6, 3)},
    "R26": {32: (2, 2, 2, 2)},
}

# BiT ResNetV2 depth -> bottleneck units per stage (big_vision models/bit.py).
BIT_DEPTHS: dict[int, tuple[int, ...]] = {
    26: (2, 2, 2, 2),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
}
# The paper's ResNet baselines (Table 6) and BiT's released sizes; any width factor k >= 1 decodes.
BIT_VARIANTS = ("BiT-R26x1", "BiT-R50x1", "BiT-R50x2", "BiT-R50x3", "BiT-R101x1", "BiT-R101x3",
                "BiT-R152x1", "BiT-R152x2", "BiT-R152x4", "BiT-R200x3")
# Ours, for tests and the demo: one or two units per stage at half of x1's width (32 channels
# at the root, the fewest GroupNorm's 32 groups allow). name: (units per stage, root width)
BIT_TINY: dict[str, tuple[tuple[int, ...], int]] = {
    "BiT-mu": ((1, 1, 1, 1), 32),
    "BiT-Ti": ((2, 2, 2, 2), 32),
}
BIT_ROOT_WIDTH = 64  # x1's root width; stage i has 64 * k * 2^i bottleneck channels

_BIT_NAME = re.compile(r"^BiT-R(?P<depth>\d+)x(?P<k>\d+)$")
_NAME = re.compile(r"^(?:(?P<resnet>R\d+)\+)?(?P<size>[A-Za-z]+)/(?P<patch>\d+)$")


def resnet_stride(stages: tuple[int, ...]) -> int:
    """Total stride of a BiT stem with `stages` (root 4, then x2 per later stage)."""
    return 4 * 2 ** (len(stages) - 1)


def accepted_variants() -> list[str]:
    plain = [f"{s}/{p}" for s in VARIANTS for p in PATCH_SIZES]
    hybrid = [f"{r}+{s}/{p}" for r, by_stride in RESNET_STAGES.items() for p in by_stride
              for s in VARIANTS]
    return plain + hybrid + list(BIT_VARIANTS) + list(BIT_TINY)


def is_bit_variant(variant: object) -> bool:
    """Whether `variant` names a BiT ResNet ("BiT-R50x1", "BiT-mu") rather than a ViT."""
    return isinstance(variant, str) and variant.strip().startswith("BiT-")


def decode_bit_variant(variant: str) -> dict[str, Any]:
    """Decode "BiT-R50x1" into `layers` (units per stage) and `width` (root width 64 * k)."""
    name = variant.strip()
    if name in BIT_TINY:
        layers, width = BIT_TINY[name]
        return dict(layers=layers, width=width)
    match = _BIT_NAME.match(name)
    depths = ", ".join(map(str, BIT_DEPTHS))
    if match is None:
        raise ValueError(f"variant {variant!r} is not of the form 'BiT-R<depth>x<k>' (depths {depths}, "
                         f"k a positive integer) nor one of {', '.join(BIT_TINY)}; e.g. 'BiT-R50x1'")
    depth, k = int(match["depth"]), int(match["k"])
    if depth not in BIT_DEPTHS:
        raise ValueError(f"variant {variant!r}: no BiT ResNet of depth {depth}; accepted depths are {depths} "
                         f"(e.g. 'BiT-R50x1', 'BiT-R152x2')")
    if k < 1:
        raise ValueError(f"variant {variant!r}: the width factor must be at least 1, e.g. 'BiT-R{depth}x1'")
    return dict(layers=BIT_DEPTHS[depth], width=BIT_ROOT_WIDTH * k)


def decode_variant(variant: str) -> dict[str, Any]:
    """Decode "B/16" or "R50+B/16" into width, depth, mlp_dim, num_heads, patch_size and
    resnet_layers (None for a plain ViT).

    `patch_size` is always the pixel footprint of one token; for a hybrid the patch
    convolution itself is 1x1 and the ResNet supplies the stride. A BiT name is refused
    here, since a caller reads ViT fields from the answer; `decode_bit_variant` decodes it.
    """
    if is_bit_variant(variant):
        raise ValueError(f"variant {variant!r} is a BiT ResNet, not a ViT: it has no patch size, width or heads; "
                         f"pass a ViT variant such as 'B/16' here (vitcore.variants.decode_bit_variant decodes it)")
    match = _NAME.match(variant.strip()) if isinstance(variant, str) else None
    sizes = ", ".join(VARIANTS)
    if match is None:
        raise ValueError(
            f"variant {variant!r} is not of the form 'SIZE/PATCH' or 'R50+SIZE/PATCH'; "
            f"sizes are {sizes}, patch sizes {', '.join(map(str, PATCH_SIZES))}, "
            f"e.g. 'B/16' or 'R50+B/16'; BiT ResNets are named 'BiT-R50x1'")
    size, patch, resnet = match["size"], int(match["patch"]), match["resnet"]
    if size not in VARIANTS:
        raise ValueError(f"variant {variant!r}: unknown size {size!r}; accepted sizes are {sizes} "
                         f"(e.g. 'Ti/16', 'B/32', 'R50+B/16')")
    width, depth, mlp_dim, num_heads = VARIANTS[size]
    resnet_layers = None
    if resnet is not None:
        by_stride = RESNET_STAGES.get(resnet)
        if by_stride is None or patch not in by_stride:
            hybrids = ", ".join(f"{r}+{size}/{p}" for r, s in RESNET_STAGES.items() for p in s)
            raise ValueError(f"variant {variant!r}: no {resnet} stem with total stride {patch}; "
                             f"accepted hybrids are {hybrids}")
        resnet_layers = by_stride[patch]
    elif patch < 1:
        raise ValueError(f"variant {variant!r}: patch size must be a positive integer, "
                         f"e.g. one of the paper's {', '.join(map(str, PATCH_SIZES))}")
    return dict(width=width, depth=depth, mlp_dim=mlp_dim, num_heads=num_heads,
                patch_size=patch, resnet_layers=resnet_layers)
