"""BiT ResNets (Kolesnikov et al. 2020), the paper's convolutional baselines (Section 4.1, Table 6).

ResNetV2 as in BiT: pre-activation bottleneck units, GroupNorm with 32 groups,
weight-standardised convolutions, a 7x7/2 root conv and a 3x3/2 max-pool, then a final
GroupNorm + ReLU + global average pool before a zero-initialised head. Module names follow
timm's `resnetv2_*_bit` models (`stem.conv`, `stages.N.blocks.M.{norm1,conv1,norm2,conv2,
norm3,conv3,downsample.conv}`, `norm`, `head.fc`), so their state dicts load unchanged;
padding follows the original BiT code (symmetric, and the max-pool pads with zeros).

The hybrid's stem (hybrid.py) is not reused: vit_jax's units there are post-activation,
'SAME'-padded and standardise kernels by (std + eps); BiT's standardise by sqrt(var + eps).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .hybrid import lecun_normal_
from .variants import decode_bit_variant

# The parts of a ViT the inspection figures of Section 4.5 need; a model's `lacks` names those
# it does not have, so a caller skips a figure in one line.
INSPECTION_PARTS = ("embedding_filters", "position_embeddings", "attention")

GROUPS = 32  # BiT: GroupNorm with 32 groups everywhere
BIT_WS_EPS = 1e-10  # the BiT code's weight-standardisation epsilon (timm's ports use 1e-8)


@dataclass
class BiTConfig:
    """Everything needed to rebuild a BiT ResNet; saved beside every checkpoint.

    `img_size` is the resolution the model is trained or evaluated at (it sets the FLOP
    count); a ResNet has no position embeddings and accepts any input size.
    """

    variant: str
    layers: tuple[int, ...]
    width: int = 64  # root width, 64 * k; stage i has width * 2^i bottleneck channels
    img_size: tuple[int, int] = (224, 224)
    num_classes: int = 1000
    head_bias_init: float = 0.0
    grad_checkpointing: bool = False
    ws_eps: float = BIT_WS_EPS
    in_chans: int = 3

    def __post_init__(self):
        if isinstance(self.img_size, int):
            self.img_size = (self.img_size, self.img_size)
        self.img_size = tuple(int(s) for s in self.img_size)
        self.layers = tuple(int(n) for n in self.layers)
        self.validate()

    def validate(self) -> None:
        if not self.layers or min(self.layers) < 1:
            raise ValueError(f"layers={self.layers} must list at least one stage, each of at least one unit, "
                             "e.g. (3, 4, 6, 3) for R50")
        if self.width < GROUPS or self.width % GROUPS:
            raise ValueError(f"width={self.width} must be a positive multiple of {GROUPS} (GroupNorm's {GROUPS} "
                             "groups), e.g. 64 for x1 or 128 for x2")
        if len(self.img_size) != 2 or min(self.img_size) < 1:
            raise ValueError(f"img_size={self.img_size} must be a positive int or (H, W), e.g. 224")
        if self.num_classes < 0:
            raise ValueError(f"num_classes={self.num_classes} must be >= 0 (0 removes the head)")
        if self.in_chans < 1 or self.ws_eps <= 0:
            raise ValueError(f"in_chans={self.in_chans} must be >= 1 and ws_eps={self.ws_eps} > 0")

    @property
    def num_features(self) -> int:
        """Channels of the last stage, the size of `pre_logits`."""
        return 4 * self.width * 2 ** (len(self.layers) - 1)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BiTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"config has unknown fields {unknown}; known fields are {sorted(known)}")
        return cls(**d)


class StdConv2d(nn.Conv2d):
    """Weight-standardised conv without bias: each output filter is standardised to zero mean
    and unit variance, (w - mean) / sqrt(var + eps), before it is applied (BiT, Section 4.1)."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int = 1, eps: float = BIT_WS_EPS):
        super().__init__(in_ch, out_ch, kernel, stride=stride, padding=kernel // 2, bias=False)
        self.eps = eps
        lecun_normal_(self.weight)  # Flax's default kernel init, as big_vision's BiT

    def standardized_weight(self) -> torch.Tensor:
        var, mean = torch.var_mean(self.weight, dim=(1, 2, 3), keepdim=True, correction=0)
        return (self.weight - mean) / torch.sqrt(var + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.standardized_weight(), None, self.stride, self.padding)


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(GROUPS, channels, eps=1e-5)


class Downsample(nn.Module):
    """Projection shortcut of a stage's first unit; it takes the pre-activated input."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, eps: float):
        super().__init__()
        self.conv = StdConv2d(in_ch, out_ch, 1, stride, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class PreActBottleneck(nn.Module):
    """ResNetV2 unit: GN-ReLU-conv1x1, GN-ReLU-conv3x3 (carrying the stride), GN-ReLU-conv1x1
    to 4x the bottleneck width, added to the shortcut without a final activation."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, *, project: bool, eps: float):
        super().__init__()
        mid = out_ch // 4
        self.downsample = Downsample(in_ch, out_ch, stride, eps) if project else None
        self.norm1 = group_norm(in_ch)
        self.conv1 = StdConv2d(in_ch, mid, 1, eps=eps)
        self.norm2 = group_norm(mid)
        self.conv2 = StdConv2d(mid, mid, 3, stride, eps)
        self.norm3 = group_norm(mid)
        self.conv3 = StdConv2d(mid, out_ch, 1, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = F.relu(self.norm1(x))
        shortcut = x if self.downsample is None else self.downsample(pre)
        y = self.conv1(pre)
        y = self.conv2(F.relu(self.norm2(y)))
        y = self.conv3(F.relu(self.norm3(y)))
        return y + shortcut


class ResNetStage(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, depth: int, stride: int, eps: float):
        super().__init__()
        self.blocks = nn.Sequential(*[
            PreActBottleneck(in_ch if i == 0 else out_ch, out_ch, stride if i == 0 else 1, project=i == 0, eps=eps)
            for i in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class ClassifierHead(nn.Module):
    """The dense head on the pooled features, kept as timm's 1x1 conv `head.fc` (K, C, 1, 1)
    so timm's state dicts load unchanged; K = 0 leaves the pooled features as the output."""

    def __init__(self, in_features: int, num_classes: int, bias_init: float = 0.0,
                 device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if num_classes == 0:
            self.fc = nn.Identity()
            return
        self.fc = nn.Conv2d(in_features, num_classes, 1, device=device, dtype=dtype)
        # BiT and Section 3.2: the head starts at zero.
        nn.init.zeros_(self.fc.weight)
        nn.init.constant_(self.fc.bias, bias_init)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.fc(pooled[:, :, None, None]).flatten(1)


class ResNetV2(nn.Module):
    """A BiT ResNet with the ViT's interface.

    forward(x) takes (B, C, H, W) in [-1, 1] and returns logits (B, num_classes).
    forward(x, return_intermediates=True) returns (logits, dict) with big_vision's names:
    "stem" (after the max-pool), "stage1".."stageN", "encoded" (after the final GroupNorm
    and ReLU, B x C x h x w), "pre_logits" (its global average, B x C) and "logits".
    There are no attention maps: `lacks` names every part of INSPECTION_PARTS.
    """

    lacks = frozenset(INSPECTION_PARTS)

    def __init__(self, config: BiTConfig):
        super().__init__()
        self.config = cfg = config
        self.stem = nn.Sequential(OrderedDict(
            conv=StdConv2d(cfg.in_chans, cfg.width, 7, 2, cfg.ws_eps),
            # The BiT code pads with zeros, then pools without padding (timm's 'fixed' stem).
            pad=nn.ConstantPad2d(1, 0.0),
            pool=nn.MaxPool2d(3, stride=2)))
        stages, in_ch = [], cfg.width
        for i, depth in enumerate(cfg.layers):
            out_ch = 4 * cfg.width * 2 ** i
            stages.append(ResNetStage(in_ch, out_ch, depth, 1 if i == 0 else 2, cfg.ws_eps))
            in_ch = out_ch
        self.stages = nn.Sequential(*stages)
        self.norm = group_norm(in_ch)
        self.head = ClassifierHead(in_ch, cfg.num_classes, cfg.head_bias_init)
        self.grad_checkpointing = cfg.grad_checkpointing

    @property
    def representation_dim(self) -> int:
        return self.config.num_features

    def _check_input(self, x: torch.Tensor) -> None:
        if x.ndim != 4 or x.shape[1] != self.config.in_chans:
            raise ValueError(f"{self.config.variant}: expected images of shape (B, {self.config.in_chans}, H, W), "
                             f"got {tuple(x.shape)}")

    def _stage(self, stage: ResNetStage, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            for blk in stage.blocks:
                x = checkpoint(blk, x, use_reentrant=False)
            return x
        return stage(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """timm semantics: the last feature map after the final GroupNorm and ReLU (B, C, h, w)."""
        self._check_input(x)
        x = self.stem(x)
        for stage in self.stages:
            x = self._stage(stage, x)
        return F.relu(self.norm(x))

    def forward_head(self, encoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pre = encoded.mean(dim=(2, 3))
        return pre, self.head(pre)

    def forward(self, x: torch.Tensor, *, return_intermediates: bool = False,
                return_attention: bool = False):
        if return_attention:
            raise ValueError(f"{self.config.variant} is a ResNet and has no attention maps ('attention' is in "
                             "model.lacks); skip the attention figures for it")
        self._check_input(x)
        out = {"stem": self.stem(x)}
        h = out["stem"]
        for i, stage in enumerate(self.stages):
            h = out[f"stage{i + 1}"] = self._stage(stage, h)
        encoded = F.relu(self.norm(h))
        pre, logits = self.forward_head(encoded)
        if not return_intermediates:
            return logits
        out.update(encoded=encoded, pre_logits=pre, logits=logits)
        return logits, out


# Options that **options of create_resnet may override, with what they mean.
BIT_OPTIONS = {
    "layers": "bottleneck units per stage, e.g. (3, 4, 6, 3)",
    "width": f"root width, 64 * k (a multiple of {GROUPS})",
    "head_bias_init": "constant initial head bias (e.g. -10 with a sigmoid loss)",
    "grad_checkpointing": "recompute units in backward to save memory",
    "ws_eps": f"weight-standardisation epsilon ({BIT_WS_EPS:g} as BiT; timm's ports use 1e-8)",
    "in_chans": "input channels",
}


def create_resnet(variant: str, *, num_classes: int = 1000, img_size: int | tuple[int, int] = 224,
                  **options: Any) -> ResNetV2:
    """Build a BiT ResNet from a variant name ("BiT-R50x1", "BiT-R152x2", "BiT-mu").

    Args:
        variant: "BiT-R<depth>x<k>" (depth 26, 50, 101, 152 or 200) or a tiny test size.
        num_classes: head outputs; 0 removes the head (logits are then pre_logits).
        img_size: the resolution it is trained at, an int or (H, W) (sets the FLOP count).
        **options: overrides from `BIT_OPTIONS`.
    """
    unknown = sorted(set(options) - set(BIT_OPTIONS))
    if unknown:
        raise ValueError(f"create_model({variant!r}): unknown option(s) {unknown} for a BiT ResNet; accepted "
                         f"options are {', '.join(BIT_OPTIONS)} (plus num_classes, img_size)")
    spec = decode_bit_variant(variant)
    spec.update(options)
    return ResNetV2(BiTConfig(variant=variant, img_size=img_size, num_classes=num_classes, **spec))


def reset_resnet_head(model: ResNetV2, num_classes: int) -> ResNetV2:
    """Fine-tuning head (Section 3.2, as BiT): one zero-initialised dense layer of K outputs."""
    model.config.num_classes = num_classes
    model.config.head_bias_init = 0.0
    ref = model.norm.weight
    model.head = ClassifierHead(model.config.num_features, num_classes, device=ref.device, dtype=ref.dtype)
    return model
