"""The ResNet (BiT) stem of the R50+ViT hybrids (Section 3.1 "Hybrid Architecture",
Section 4.1 "Model Variants").

BiT replaces BatchNorm by GroupNorm and standardises every conv kernel (Kolesnikov et
al. 2020). Everything follows the official vit_jax models_resnet.py so that its `.npz`
checkpoints reproduce their outputs: Flax's 'SAME' padding (asymmetric, extra pixel on
the bottom/right), weight standardisation as (w - mean) / (std + 1e-5), GroupNorm with
32 groups and epsilon 1e-6, and the stride on the 3x3 conv of each bottleneck. Module
names follow timm's hybrid backbone (`stem.conv`, `stages.i.blocks.j.conv1`, ...).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow/Flax 'SAME' padding for one axis: (before, after)."""
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def pad_same(x: torch.Tensor, kernel: int, stride: int, value: float = 0.0) -> torch.Tensor:
    top, bottom = same_padding(x.shape[-2], kernel, stride)
    left, right = same_padding(x.shape[-1], kernel, stride)
    if top or bottom or left or right:
        x = F.pad(x, (left, right, top, bottom), value=value)
    return x


def lecun_normal_(w: torch.Tensor) -> torch.Tensor:
    """Flax's default kernel init: truncated normal with variance 1/fan_in."""
    fan_in = w[0].numel()
    # 0.8796 is the std of a unit normal truncated to [-2, 2]; dividing restores variance.
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978
    return nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)


class StdConv2d(nn.Conv2d):
    """Weight-standardised conv with 'SAME' padding and no bias (BiT)."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int = 1, eps: float = 1e-5):
        super().__init__(in_ch, out_ch, kernel, stride=stride, padding=0, bias=False)
        self.eps = eps
        lecun_normal_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        std = w.std(dim=(1, 2, 3), keepdim=True, unbiased=False)
        w = (w - mean) / (std + self.eps)
        x = pad_same(x, self.kernel_size[0], self.stride[0])
        return F.conv2d(x, w, None, self.stride)


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6)


class Downsample(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int):
        super().__init__()
        self.conv = StdConv2d(in_ch, out_ch, 1, stride)
        self.norm = group_norm(out_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    """Post-activation bottleneck unit of vit_jax's ResidualUnit."""

    def __init__(self, in_ch: int, features: int, stride: int):
        super().__init__()
        out_ch = 4 * features
        self.downsample = (Downsample(in_ch, out_ch, stride)
                           if in_ch != out_ch or stride != 1 else None)
        self.conv1 = StdConv2d(in_ch, features, 1)
        self.norm1 = group_norm(features)
        self.conv2 = StdConv2d(features, features, 3, stride)
        self.norm2 = group_norm(features)
        self.conv3 = StdConv2d(features, out_ch, 1)
        self.norm3 = group_norm(out_ch)
        # Zero-init the last GroupNorm scale so each unit starts as the identity (vit_jax).
        nn.init.zeros_(self.norm3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        y = self.norm3(self.conv3(y))
        return F.relu(shortcut + y)


class Stage(nn.Module):
    def __init__(self, in_ch: int, features: int, depth: int, stride: int):
        super().__init__()
        self.blocks = nn.Sequential(*[
            Bottleneck(in_ch if i == 0 else 4 * features, features, stride if i == 0 else 1)
            for i in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class Stem(nn.Module):
    def __init__(self, in_chans: int, width: int):
        super().__init__()
        self.conv = StdConv2d(in_chans, width, 7, 2)
        self.norm = group_norm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.conv(x)))
        # Flax max_pool pads 'SAME' with -inf, so padding never wins the max.
        return F.max_pool2d(pad_same(x, 3, 2, value=float("-inf")), 3, 2)


class ResNetBackbone(nn.Module):
    """Root block and stages; stage i has 64 * 2^i bottleneck features, stride 2 from
    the second stage on."""

    def __init__(self, layers: tuple[int, ...], *, in_chans: int = 3, width: int = 64):
        super().__init__()
        self.layers = tuple(layers)
        self.stem = Stem(in_chans, width)
        stages, in_ch = [], width
        for i, depth in enumerate(self.layers):
            features = width * 2 ** i
            stages.append(Stage(in_ch, features, depth, 1 if i == 0 else 2))
            in_ch = 4 * features
        self.stages = nn.Sequential(*stages)
        self.out_channels = in_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))
