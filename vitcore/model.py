"""The Vision Transformer of Section 3.1 (Eq. 1-4), its heads, and `create_model`.

Module names follow timm (`patch_embed.proj`, `cls_token`, `pos_embed`,
`blocks.N.attn.qkv`, `norm`, `pre_logits.fc`, `head`) because they are the checkpoint
format; initialisation and numerics follow the official vit_jax code.
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

from .hybrid import ResNetBackbone, lecun_normal_
from .posembed import POSEMB_KINDS, AxisPosEmbed, RelativePositionBias, sincos_2d
from .resnet import ResNetV2, create_resnet, reset_resnet_head
from .variants import decode_variant, is_bit_variant, resnet_stride

CLASSIFIERS = ("token", "gap")
GELU_FLAVOURS = {"tanh": "tanh", "erf": "none"}  # our name -> nn.GELU(approximate=...)
ATTN_IMPLS = ("sdpa", "explicit")


@dataclass
class ViTConfig:
    """Everything needed to rebuild a model; saved beside every checkpoint."""

    variant: str
    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    patch_size: int
    img_size: tuple[int, int] = (224, 224)
    resnet_layers: tuple[int, ...] | None = None
    num_classes: int = 1000
    classifier: str = "token"
    representation_size: int | None = None
    posemb: str = "learn"
    dropout: float = 0.0
    attention_dropout: float = 0.0
    drop_path_rate: float = 0.0
    # The official JAX code uses Flax's nn.gelu, whose default is the tanh approximation;
    # timm uses the exact erf form. Loaders set this to match the weights' source.
    gelu: str = "tanh"
    attn_impl: str = "sdpa"
    grad_checkpointing: bool = False
    head_bias_init: float = 0.0
    in_chans: int = 3

    def __post_init__(self):
        if isinstance(self.img_size, int):
            self.img_size = (self.img_size, self.img_size)
        self.img_size = tuple(int(s) for s in self.img_size)
        if self.resnet_layers is not None:
            self.resnet_layers = tuple(self.resnet_layers)
        self.validate()

    def validate(self) -> None:
        def choose(name, value, allowed):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported; use one of {', '.join(allowed)}")
        choose("classifier", self.classifier, CLASSIFIERS)
        choose("posemb", self.posemb, POSEMB_KINDS)
        choose("gelu", self.gelu, tuple(GELU_FLAVOURS))
        choose("attn_impl", self.attn_impl, ATTN_IMPLS)
        if len(self.img_size) != 2 or any(s % self.patch_size for s in self.img_size):
            raise ValueError(
                f"img_size={self.img_size} is not a multiple of the patch size {self.patch_size} "
                f"of {self.variant}; pick e.g. img_size={self.patch_size * max(1, self.img_size[0] // self.patch_size)}")
        if self.width % self.num_heads:
            raise ValueError(f"width={self.width} is not divisible by num_heads={self.num_heads}")
        if self.resnet_layers is not None and resnet_stride(self.resnet_layers) != self.patch_size:
            raise ValueError(f"resnet_layers={self.resnet_layers} give stride "
                             f"{resnet_stride(self.resnet_layers)}, not the patch size {self.patch_size}")
        for name in ("depth", "width", "mlp_dim", "num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.num_classes < 0:
            raise ValueError(f"num_classes={self.num_classes} must be >= 0 (0 removes the head)")
        if not 0 <= self.drop_path_rate < 1:
            raise ValueError(f"drop_path_rate={self.drop_path_rate} must be in [0, 1)")

    @property
    def grid(self) -> tuple[int, int]:
        return (self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size)

    @property
    def num_prefix_tokens(self) -> int:
        return 1 if self.classifier == "token" else 0

    @property
    def seq_len(self) -> int:
        return self.grid[0] * self.grid[1] + self.num_prefix_tokens

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ViTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"config has unknown fields {unknown}; known fields are {sorted(known)}")
        return cls(**d)


class Attention(nn.Module):
    """Multi-head self-attention (Appendix A) with one fused qkv projection.

    The default path is torch's scaled_dot_product_attention, which dispatches to the
    flash or memory-efficient kernels on GPU. The explicit path materialises the softmax
    and is used only when the weights are asked for (inspection) or forced.
    """

    def __init__(self, dim: int, num_heads: int, *, attn_drop: float, proj_drop: float,
                 rel_pos_len: int | None = None, impl: str = "sdpa"):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.impl = impl
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)  # Appendix B.1: after every dense but qkv
        self.rel_pos = (RelativePositionBias(rel_pos_len, self.head_dim)
                        if rel_pos_len is not None else None)
        # vit_jax: xavier-uniform per q/k/v projection (a (D, heads, hd) kernel each), zero bias.
        for w in self.qkv.weight.chunk(3, dim=0):
            nn.init.xavier_uniform_(w)
        nn.init.xavier_uniform_(self.proj.weight)
        nn.init.zeros_(self.qkv.bias)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor, return_weights: bool = False):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        bias = self.rel_pos(q * self.scale) if self.rel_pos is not None else None
        drop = self.attn_drop if self.training else 0.0
        weights = None
        if self.impl == "sdpa" and not return_weights:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=drop)
        else:
            logits = (q * self.scale) @ k.transpose(-2, -1)
            if bias is not None:
                logits = logits + bias
            weights = logits.softmax(dim=-1)
            out = F.dropout(weights, drop, self.training) @ v
        out = out.transpose(1, 2).reshape(b, n, d)
        return self.proj_drop(self.proj(out)), weights


class Mlp(nn.Module):
    """Dense -> GELU -> dropout -> Dense -> dropout (Eq. 3, Appendix B.1)."""

    def __init__(self, dim: int, hidden: int, *, drop: float, gelu: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate=GELU_FLAVOURS[gelu])
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(drop)
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.normal_(fc.bias, std=1e-6)  # vit_jax MlpBlock bias init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


def drop_path(x: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """Stochastic depth (Huang et al. 2016; DeiT, AugReg): in training, zero a residual branch for
    each image with probability ``rate`` and scale the kept ones by 1/(1-rate); the identity
    otherwise. At rate 0 it draws no random numbers, so the dropout stream is as it was."""
    if not rate or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1.0 - rate)
    return x * keep.div_(1.0 - rate)


class DropPath(nn.Module):
    """:func:`drop_path` as a module (timm's name); it has no parameters, so no state."""

    def __init__(self, rate: float = 0.0):
        super().__init__()
        self.rate = float(rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.rate, self.training)

    def extra_repr(self) -> str:
        return f"rate={self.rate:g}"


def drop_path_rates(rate: float, depth: int) -> list[float]:
    """Each block's stochastic-depth rate: 0 at the first block rising linearly to ``rate`` at the
    last, as timm and DeiT set it (``torch.linspace(0, rate, depth)``)."""
    return [rate * i / (depth - 1) if depth > 1 else rate for i in range(depth)]


class Block(nn.Module):
    """Pre-LN encoder block, Eq. 2-3. LayerNorm epsilon 1e-6 as in Flax."""

    def __init__(self, cfg: ViTConfig, drop_path_rate: float = 0.0):
        super().__init__()
        rel_len = cfg.seq_len if cfg.posemb == "relative" else None
        self.norm1 = nn.LayerNorm(cfg.width, eps=1e-6)
        self.attn = Attention(cfg.width, cfg.num_heads, attn_drop=cfg.attention_dropout,
                              proj_drop=cfg.dropout, rel_pos_len=rel_len, impl=cfg.attn_impl)
        self.norm2 = nn.LayerNorm(cfg.width, eps=1e-6)
        self.mlp = Mlp(cfg.width, cfg.mlp_dim, drop=cfg.dropout, gelu=cfg.gelu)
        self.drop_path1 = DropPath(drop_path_rate)
        self.drop_path2 = DropPath(drop_path_rate)

    def forward(self, x: torch.Tensor, return_weights: bool = False):
        y, weights = self.attn(self.norm1(x), return_weights)
        x = x + self.drop_path1(y)
        x = x + self.drop_path2(self.mlp(self.norm2(x)))
        return x, weights


class PatchEmbed(nn.Module):
    """Eq. 1's linear projection E of flattened patches, as a stride-P convolution."""

    def __init__(self, patch_size: int, in_chans: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, patch_size, stride=patch_size)
        lecun_normal_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class HybridEmbed(PatchEmbed):
    """Section 3.1 hybrid: E applied to 1x1 patches of a ResNet feature map."""

    def __init__(self, layers: tuple[int, ...], patch_size: int, in_chans: int, dim: int):
        backbone = ResNetBackbone(layers, in_chans=in_chans)
        super().__init__(patch_size // resnet_stride(layers), backbone.out_channels, dim)
        self.backbone = backbone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.backbone(x))


class VisionTransformer(nn.Module):
    """ViT of Eq. 1-4 with 'token' or 'gap' pooling, an optional tanh pre-logits layer
    (pre-training head) and a zero-initialised linear head.

    forward(x) takes (B, 3, H, W) in [-1, 1] and returns logits (B, num_classes).
    forward(x, return_intermediates=True) returns (logits, dict) with big_vision's names:
    "stem" (patch embeddings, B x N x D), "with_posemb", "encoded" (after the final LN,
    B x L x D), "pre_logits" (the image representation y, Eq. 4, after the optional tanh
    layer) and "logits"; with return_attention=True also "attention", a list of
    (B, heads, L, L) softmax weights per layer.
    """

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = cfg = config
        d = cfg.width
        if cfg.resnet_layers is None:
            self.patch_embed = PatchEmbed(cfg.patch_size, cfg.in_chans, d)
        else:
            self.patch_embed = HybridEmbed(cfg.resnet_layers, cfg.patch_size, cfg.in_chans, d)
        # vit_jax initialises [class] to zeros.
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if cfg.classifier == "token" else None
        self.pos_embed_2d = None
        if cfg.posemb == "learn":
            self.pos_embed = nn.Parameter(torch.empty(1, cfg.seq_len, d).normal_(std=0.02))
        elif cfg.posemb == "sincos2d":
            # Fixed, so derived from the grid on every build instead of stored.
            self.register_buffer("pos_embed", sincos_2d(cfg.grid, d)[None], persistent=False)
        else:
            self.pos_embed = None
            if cfg.posemb == "2d":
                self.pos_embed_2d = AxisPosEmbed(cfg.grid, d, with_class_slot=cfg.classifier == "token")
        self.pos_drop = nn.Dropout(cfg.dropout)  # Appendix B.1: after adding positions
        self.blocks = nn.ModuleList([Block(cfg, rate) for rate in drop_path_rates(cfg.drop_path_rate, cfg.depth)])
        self.norm = nn.LayerNorm(d, eps=1e-6)
        self.pre_logits = self._make_pre_logits(cfg.representation_size)
        self.head = self._make_head(cfg.num_classes, cfg.head_bias_init)
        self.grad_checkpointing = cfg.grad_checkpointing

    def _make_pre_logits(self, size: int | None) -> nn.Module:
        if not size:
            return nn.Identity()
        fc = nn.Linear(self.config.width, size)
        lecun_normal_(fc.weight)
        nn.init.zeros_(fc.bias)
        return nn.Sequential(OrderedDict(fc=fc, act=nn.Tanh()))

    def _make_head(self, num_classes: int, bias_init: float = 0.0) -> nn.Module:
        if num_classes == 0:
            return nn.Identity()
        head = nn.Linear(self.config.representation_size or self.config.width, num_classes,
                         device=self.norm.weight.device, dtype=self.norm.weight.dtype)
        # Section 3.2 / B.1.1: the classification head starts at zero.
        nn.init.zeros_(head.weight)
        nn.init.constant_(head.bias, bias_init)
        return head

    @property
    def representation_dim(self) -> int:
        return self.config.representation_size or self.config.width

    @property
    def lacks(self) -> frozenset[str]:
        """The parts of `resnet.INSPECTION_PARTS` this model has not: a hybrid's patch filters
        act on ResNet features, not pixels; 'relative' and 'none' have no absolute positions."""
        missing = set()
        if self.config.resnet_layers is not None:
            missing.add("embedding_filters")
        if self.config.posemb not in ("learn", "sincos2d", "2d"):
            missing.add("position_embeddings")
        return frozenset(missing)

    def _check_input(self, x: torch.Tensor) -> None:
        cfg = self.config
        if x.ndim != 4 or x.shape[1] != cfg.in_chans:
            raise ValueError(f"expected images of shape (B, {cfg.in_chans}, H, W), got {tuple(x.shape)}")
        if tuple(x.shape[-2:]) != cfg.img_size:
            raise ValueError(
                f"input is {x.shape[-2]}x{x.shape[-1]} but {cfg.variant} was built for "
                f"{cfg.img_size[0]}x{cfg.img_size[1]}; build the model with img_size={tuple(x.shape[-2:])} "
                f"and load the weights into it (position embeddings are interpolated, Section 3.2)")

    def embed_patches(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> patch embeddings x_p E, shape (B, N, D)."""
        self._check_input(x)
        return self.patch_embed(x)

    def add_positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """Eq. 1: prepend [class] and add E_pos; (B, N, D) -> (B, L, D)."""
        cfg = self.config
        p = cfg.num_prefix_tokens
        cls_pos = None
        if cfg.posemb in ("learn", "sincos2d"):
            patch_pos = self.pos_embed[:, p:] if cfg.posemb == "learn" else self.pos_embed
            cls_pos = self.pos_embed[:, :p] if cfg.posemb == "learn" and p else None
            tokens = tokens + patch_pos.to(tokens.dtype)
        elif cfg.posemb == "2d":
            tokens = tokens + self.pos_embed_2d.patch_embeddings().to(tokens.dtype)
            cls_pos = self.pos_embed_2d.pos_embed_cls
        if self.cls_token is not None:
            cls = self.cls_token if cls_pos is None else self.cls_token + cls_pos
            tokens = torch.cat([cls.to(tokens.dtype).expand(tokens.shape[0], -1, -1), tokens], dim=1)
        return self.pos_drop(tokens)

    def encode(self, x: torch.Tensor, return_attention: bool = False):
        """Blocks and final LN over a (B, L, D) sequence; returns (encoded, attention list)."""
        attention = []
        for blk in self.blocks:
            if self.grad_checkpointing and self.training and torch.is_grad_enabled() and not return_attention:
                x, w = checkpoint(blk, x, use_reentrant=False)
            else:
                x, w = blk(x, return_attention)
            if return_attention:
                attention.append(w)
        return self.norm(x), attention

    def pool(self, encoded: torch.Tensor) -> torch.Tensor:
        # vit_jax takes GAP after encoder_norm (timm pools first and normalises after).
        return encoded[:, 0] if self.config.classifier == "token" else encoded.mean(dim=1)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """timm semantics: the encoded token sequence (B, L, D), after the final LN."""
        return self.encode(self.add_positions(self.embed_patches(x)))[0]

    def forward_head(self, encoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pre = self.pre_logits(self.pool(encoded))
        return pre, self.head(pre)

    def forward(self, x: torch.Tensor, *, return_intermediates: bool = False,
                return_attention: bool = False):
        stem = self.embed_patches(x)
        with_posemb = self.add_positions(stem)
        encoded, attention = self.encode(with_posemb, return_attention)
        pre, logits = self.forward_head(encoded)
        if not (return_intermediates or return_attention):
            return logits
        out = {"stem": stem, "with_posemb": with_posemb, "encoded": encoded,
               "pre_logits": pre, "logits": logits}
        if return_attention:
            out["attention"] = attention
        return logits, out


# Options that **options of create_model may override, with what they mean.
OPTIONS = {
    "depth": "number of encoder blocks",
    "width": "hidden size D",
    "mlp_dim": "MLP hidden size",
    "num_heads": "attention heads",
    "posemb": f"position embedding: {', '.join(POSEMB_KINDS)} (Appendix D.4)",
    "dropout": "dropout rate (Appendix B.1 placement)",
    "attention_dropout": "dropout on attention weights",
    "drop_path_rate": "stochastic depth of the last block; 0 at the first, linear in between",
    "gelu": "'tanh' (official JAX) or 'erf' (timm)",
    "attn_impl": "'sdpa' (fused) or 'explicit'",
    "grad_checkpointing": "recompute blocks in backward to save memory",
    "head_bias_init": "constant initial head bias (e.g. -10 with a sigmoid loss)",
    "in_chans": "input channels",
}


def create_model(variant: str, *, num_classes: int = 1000, img_size: int | tuple[int, int] = 224,
                 classifier: str | None = None, representation_size: int | None = None,
                 **options: Any) -> VisionTransformer | ResNetV2:
    """Build a ViT from a variant name ("Ti/16", "B/16", "R50+B/16", "mu/8"), or a BiT ResNet
    ("BiT-R50x1"; see `resnet.create_resnet` for its options).

    Args:
        variant: size/patch, optionally prefixed by a ResNet stem ("R50+").
        num_classes: head outputs; 0 removes the head (logits are then pre_logits).
        img_size: input resolution, an int or (H, W); a multiple of the patch size.
        classifier: 'token' ([class] token, Eq. 4; the default) or 'gap' (global average
            pooling, the only one a ResNet has).
        representation_size: size of the tanh pre-logits layer used in pre-training
            (the paper uses the width); None for the single linear fine-tuning head.
        **options: overrides from `OPTIONS` (depth, width, mlp_dim, num_heads, posemb,
            dropout, attention_dropout, drop_path_rate, gelu, attn_impl, grad_checkpointing,
            head_bias_init, in_chans).
    """
    if is_bit_variant(variant):
        if classifier not in (None, "gap") or representation_size:
            raise ValueError(f"create_model({variant!r}): a BiT ResNet pools by global average into one dense "
                             f"head; drop classifier={classifier!r} and representation_size={representation_size!r}")
        return create_resnet(variant, num_classes=num_classes, img_size=img_size, **options)
    classifier = classifier or "token"
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"create_model({variant!r}): unknown option(s) {unknown}; accepted options are "
                         f"{', '.join(OPTIONS)} (plus num_classes, img_size, classifier, representation_size)")
    spec = decode_variant(variant)
    spec.update(options)
    config = ViTConfig(variant=variant, img_size=img_size, num_classes=num_classes,
                       classifier=classifier, representation_size=representation_size, **spec)
    return VisionTransformer(config)


def reset_head(model: VisionTransformer | ResNetV2, num_classes: int) -> VisionTransformer | ResNetV2:
    """Prepare a pre-trained model for fine-tuning: remove the whole head (the tanh
    pre-logits layer too) and attach one zero-initialised D x K linear layer
    (Section 3.2; Appendix B.1.1 found this "a little more robust")."""
    if isinstance(model, ResNetV2):
        return reset_resnet_head(model, num_classes)
    model.config.representation_size = None
    model.config.num_classes = num_classes
    model.config.head_bias_init = 0.0
    model.pre_logits = nn.Identity()
    model.head = model._make_head(num_classes)
    return model


def set_gelu(model: nn.Module, flavour: str) -> None:
    """Switch every MLP's GELU to 'tanh' or 'erf' to match where the weights came from."""
    if flavour not in GELU_FLAVOURS:
        raise ValueError(f"gelu={flavour!r} is not supported; use one of {', '.join(GELU_FLAVOURS)}")
    for m in model.modules():
        if isinstance(m, Mlp):
            m.act.approximate = GELU_FLAVOURS[flavour]
    if isinstance(getattr(model, "config", None), ViTConfig):
        model.config.gelu = flavour
