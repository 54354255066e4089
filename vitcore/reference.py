"""A deliberately plain ViT: explicit softmax attention, fp32, nothing fused.

It is the baseline that benchmarks/vit_step.py measures the project's model against,
and an independent oracle in the tests. Parameter names are timm's, so the state dict
of a plain `VisionTransformer` with learned 1D position embeddings loads into it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .model import ViTConfig


class _LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def _gelu(x, flavour: str):
    if flavour == "erf":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


class _Attn(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, hd).transpose(1, 2) for t in (q, k, v))
        logits = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hd)
        weights = torch.exp(logits - logits.amax(-1, keepdim=True))
        weights = weights / weights.sum(-1, keepdim=True)
        return self.proj(torch.matmul(weights, v).transpose(1, 2).reshape(b, n, d))


class _Mlp(nn.Module):
    def __init__(self, dim, hidden, gelu):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.gelu = gelu

    def forward(self, x):
        return self.fc2(_gelu(self.fc1(x), self.gelu))


class _Block(nn.Module):
    def __init__(self, dim, heads, hidden, gelu):
        super().__init__()
        self.norm1, self.attn = _LayerNorm(dim), _Attn(dim, heads)
        self.norm2, self.mlp = _LayerNorm(dim), _Mlp(dim, hidden, gelu)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _Patches(nn.Module):
    def __init__(self, p, c, d):
        super().__init__()
        self.proj = nn.Conv2d(c, d, p, stride=p)


class ReferenceViT(nn.Module):
    """Plain ViT for a `ViTConfig` with posemb='learn' and no ResNet stem; patches are
    cut out and multiplied by E explicitly."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        if cfg.posemb != "learn" or cfg.resnet_layers is not None:
            raise ValueError(f"ReferenceViT covers plain ViTs with learned 1D position embeddings, "
                             f"not posemb={cfg.posemb!r} / resnet_layers={cfg.resnet_layers}")
        self.cfg = cfg
        d = cfg.width
        self.patch_embed = _Patches(cfg.patch_size, cfg.in_chans, d)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if cfg.classifier == "token" else None
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.seq_len, d) * 0.02)
        self.blocks = nn.ModuleList(_Block(d, cfg.num_heads, cfg.mlp_dim, cfg.gelu) for _ in range(cfg.depth))
        self.norm = _LayerNorm(d)
        if cfg.representation_size:
            self.pre_logits = nn.Sequential()
            self.pre_logits.add_module("fc", nn.Linear(d, cfg.representation_size))
        self.head = nn.Linear(cfg.representation_size or d, cfg.num_classes)

    def forward(self, x):
        cfg, p = self.cfg, self.cfg.patch_size
        b, c, h, w = x.shape
        patches = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
        e = self.patch_embed.proj.weight.reshape(cfg.width, -1)
        tokens = patches @ e.t() + self.patch_embed.proj.bias
        if self.cls_token is not None:
            tokens = torch.cat([self.cls_token.expand(b, -1, -1), tokens], dim=1)
        x = tokens + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        y = x[:, 0] if cfg.classifier == "token" else x.mean(1)
        if cfg.representation_size:
            y = torch.tanh(self.pre_logits.fc(y))
        return self.head(y)
