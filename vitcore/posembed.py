"""Position embeddings: the paper's learnable 1D default, the Appendix D.4 ablations
(none, 2D, relative), fixed 2D sin-cos, and the Section 3.2 resize for fine-tuning at a
higher resolution.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

POSEMB_KINDS = ("learn", "none", "2d", "relative", "sincos2d")


def resize_grid(grid: torch.Tensor, new_hw: tuple[int, int]) -> torch.Tensor:
    """Bilinearly resize a (gh, gw, D) grid of embeddings to `new_hw`.

    Section 3.2 interpolates the pre-trained embeddings "according to their location in
    the original image". The official checkpoint.py uses scipy.ndimage.zoom(order=1),
    which maps corner cells onto corner cells: that is align_corners=True, not False.
    """
    gh, gw, _ = grid.shape
    if (gh, gw) == tuple(new_hw):
        return grid
    dtype = grid.dtype
    # At least fp32 for the arithmetic; fp64 inputs keep their precision.
    x = grid.permute(2, 0, 1).unsqueeze(0).to(torch.promote_types(dtype, torch.float32))
    x = F.interpolate(x, size=tuple(new_hw), mode="bilinear", align_corners=True)
    return x.squeeze(0).permute(1, 2, 0).to(dtype)


def resize_1d(table: torch.Tensor, new_len: int) -> torch.Tensor:
    """Linearly resize a (L, D) table along L with the same corner-to-corner rule."""
    if table.shape[0] == new_len:
        return table
    x = table.t().unsqueeze(0).to(torch.promote_types(table.dtype, torch.float32))
    x = F.interpolate(x, size=new_len, mode="linear", align_corners=True)
    return x.squeeze(0).t().to(table.dtype)


def adapt_pos_embed(posemb: torch.Tensor, *, new_grid: tuple[int, int], new_prefix: int,
                    old_prefix: int, old_grid: tuple[int, int] | None = None) -> torch.Tensor:
    """Fit a (1, old_prefix + gh*gw, D) position embedding to a model whose grid is
    `new_grid` with `new_prefix` class slots (1 for 'token' pooling, 0 for 'gap').

    The class slot is split off first and kept unchanged (Section 3.2 only re-grids
    the patch positions). A checkpoint without a class slot (big_vision adds the
    position embedding before concatenating [class]) gives the class token a zero
    embedding, which is exactly what that checkpoint computed.
    """
    if posemb.ndim == 2:
        posemb = posemb.unsqueeze(0)
    prefix, grid = posemb[:, :old_prefix], posemb[0, old_prefix:]
    n_old, dim = grid.shape
    if old_grid is None:
        side = math.isqrt(n_old)
        if side * side != n_old:
            raise ValueError(
                f"position embedding has {n_old} patch rows, not a square grid; pass old_grid=(h, w)")
        old_grid = (side, side)
    if old_grid[0] * old_grid[1] != n_old:
        raise ValueError(f"position embedding has {n_old} patch rows but old_grid={old_grid}")
    grid = resize_grid(grid.reshape(old_grid[0], old_grid[1], dim), new_grid)
    grid = grid.reshape(1, new_grid[0] * new_grid[1], dim)
    if new_prefix == 0:
        return grid
    if old_prefix == 0:
        prefix = posemb.new_zeros(1, new_prefix, dim)
    return torch.cat([prefix[:, :new_prefix], grid], dim=1)


def sincos_1d(positions: torch.Tensor, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """The original Transformer's encoding: PE(p, 2i) = sin(p / T^(2i/d)),
    PE(p, 2i+1) = cos(p / T^(2i/d)) (Vaswani et al. 2017, Section 3.5)."""
    if dim % 2:
        raise ValueError(f"sin-cos encoding needs an even dimension, got {dim}")
    i = torch.arange(dim // 2, dtype=torch.float64, device=positions.device)
    inv_freq = temperature ** (-2.0 * i / dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None]
    out = torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(len(positions), dim)
    return out.float()


def sincos_2d(grid: tuple[int, int], dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 2D embedding of shape (gh*gw, dim): the 1D sinusoid of the row index in
    the first dim/2 channels and of the column index in the last dim/2, raster order."""
    if dim % 4:
        raise ValueError(f"2D sin-cos position embedding needs width divisible by 4, got {dim}")
    gh, gw = grid
    ys = sincos_1d(torch.arange(gh), dim // 2, temperature)
    xs = sincos_1d(torch.arange(gw), dim // 2, temperature)
    return torch.cat([ys[:, None].expand(gh, gw, -1), xs[None].expand(gh, gw, -1)], dim=-1
                     ).reshape(gh * gw, dim)


class AxisPosEmbed(nn.Module):
    """Appendix D.4 '2-dimensional positional embedding': one learned table per axis,
    each of size D/2, concatenated per patch as [Y-embedding, X-embedding]."""

    def __init__(self, grid: tuple[int, int], dim: int, *, with_class_slot: bool):
        super().__init__()
        if dim % 2:
            raise ValueError(f"posemb='2d' needs an even width, got {dim}")
        self.grid = tuple(grid)
        self.pos_embed_y = nn.Parameter(torch.empty(grid[0], dim // 2).normal_(std=0.02))
        self.pos_embed_x = nn.Parameter(torch.empty(grid[1], dim // 2).normal_(std=0.02))
        self.pos_embed_cls = (nn.Parameter(torch.empty(1, 1, dim).normal_(std=0.02))
                              if with_class_slot else None)

    def patch_embeddings(self) -> torch.Tensor:
        gh, gw = self.grid
        y = self.pos_embed_y[:, None].expand(gh, gw, -1)
        x = self.pos_embed_x[None].expand(gh, gw, -1)
        return torch.cat([y, x], dim=-1).reshape(1, gh * gw, -1)


class RelativePositionBias(nn.Module):
    """Appendix D.4 relative attention: each offset p_q - p_k in the 1D token sequence
    has an embedding; "the original query" attends to these embeddings as keys and the
    resulting logits are added to the content logits before the softmax.

    Tables are shared across heads, as in Shaw et al. (2018), and each layer has its own.
    """

    def __init__(self, seq_len: int, head_dim: int):
        super().__init__()
        self.seq_len = seq_len
        self.rel_embed = nn.Parameter(torch.empty(2 * seq_len - 1, head_dim).normal_(std=0.02))
        pos = torch.arange(seq_len)
        self.register_buffer("index", pos[:, None] - pos[None, :] + seq_len - 1, persistent=False)

    def forward(self, q_scaled: torch.Tensor) -> torch.Tensor:
        """q_scaled: (B, H, L, hd), already multiplied by 1/sqrt(hd). Returns (B, H, L, L)."""
        logits = q_scaled @ self.rel_embed.t()  # (B, H, L, 2L-1)
        index = self.index.expand(*logits.shape[:-1], self.seq_len)
        return logits.gather(-1, index)
