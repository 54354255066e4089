"""Masked patch prediction, the self-supervised objective of Appendix B.1.2.

50% of the patch embeddings are corrupted: 80% of those become a learnable [mask]
embedding, 10% a random other patch embedding, 10% stay as they are (BERT's recipe).
The model predicts the 3-bit mean colour (8^3 = 512 classes) of every corrupted patch
from that patch's output representation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model import VisionTransformer


def mpp_targets(images: torch.Tensor, patch_size: int, bits: int = 3) -> torch.Tensor:
    """Class index of each patch's mean colour quantised to `bits` per channel.

    images: (B, 3, H, W) in [-1, 1]. Returns (B, N) long in [0, 2^(3*bits)), raster order
    of patches, index = (r * 2^bits + g) * 2^bits + b.
    """
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"mpp_targets expects RGB images (B, 3, H, W), got {tuple(images.shape)}")
    b, _, h, w = images.shape
    if h % patch_size or w % patch_size:
        raise ValueError(f"image size {h}x{w} is not a multiple of patch size {patch_size}")
    mean = F.avg_pool2d(images.float(), patch_size)  # (B, 3, gh, gw)
    levels = 2 ** bits
    q = ((mean + 1) / 2 * levels).floor().clamp_(0, levels - 1).long()
    idx = (q[:, 0] * levels + q[:, 1]) * levels + q[:, 2]
    return idx.flatten(1)


def corrupt_patches(tokens: torch.Tensor, mask_token: torch.Tensor, *, corrupt_rate: float = 0.5,
                    mask_frac: float = 0.8, random_frac: float = 0.1,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply the B.1.2 corruption to patch embeddings (B, N, D).

    Exactly round(corrupt_rate * N) patches per image are chosen. Returns (corrupted
    tokens, corrupted mask (B, N) bool, action (B, N) long: 0 kept, 1 [mask], 2 random
    other patch, 3 corrupted-but-unchanged).
    """
    b, n, d = tokens.shape
    dev = tokens.device
    num = int(round(corrupt_rate * n))
    order = torch.rand(b, n, generator=generator, device=dev).argsort(dim=1)
    corrupted = torch.zeros(b, n, dtype=torch.bool, device=dev)
    corrupted.scatter_(1, order[:, :num], True)
    u = torch.rand(b, n, generator=generator, device=dev)
    action = torch.zeros(b, n, dtype=torch.long, device=dev)
    action[corrupted & (u < mask_frac)] = 1
    action[corrupted & (u >= mask_frac) & (u < mask_frac + random_frac)] = 2
    action[corrupted & (u >= mask_frac + random_frac)] = 3
    # A "random other patch": any patch of the batch except the one being replaced.
    flat = tokens.reshape(b * n, d)
    src = torch.randint(0, b * n - 1, (b * n,), generator=generator, device=dev)
    src = src + (src >= torch.arange(b * n, device=dev)).long()
    out = torch.where((action == 1)[..., None], mask_token.to(tokens.dtype).expand(b, n, d), tokens)
    out = torch.where((action == 2)[..., None], flat[src].reshape(b, n, d), out)
    return out, corrupted, action


class MaskedPatchPrediction(nn.Module):
    """Wrap a ViT for B.1.2 pre-training. `loss(images)` is the objective; the wrapped
    model is `.backbone`, which is what one saves and fine-tunes afterwards."""

    def __init__(self, backbone: VisionTransformer, *, bits: int = 3, corrupt_rate: float = 0.5,
                 mask_frac: float = 0.8, random_frac: float = 0.1):
        super().__init__()
        if not isinstance(backbone, VisionTransformer):
            raise TypeError(f"masked patch prediction (Appendix B.1.2) corrupts the patch tokens of a ViT; "
                            f"{type(backbone).__name__} has none, so pre-train it with a classification loss")
        self.backbone = backbone
        d = backbone.config.width
        self.bits, self.corrupt_rate = bits, corrupt_rate
        self.mask_frac, self.random_frac = mask_frac, random_frac
        self.mask_token = nn.Parameter(torch.empty(1, 1, d).normal_(std=0.02))
        self.mpp_head = nn.Linear(d, 2 ** (3 * bits))
        nn.init.zeros_(self.mpp_head.weight)
        nn.init.zeros_(self.mpp_head.bias)

    def forward(self, images: torch.Tensor, generator: torch.Generator | None = None):
        """Returns (logits (B, N, 512), targets (B, N), corrupted mask (B, N))."""
        vit = self.backbone
        tokens = vit.embed_patches(images)
        tokens, corrupted, _ = corrupt_patches(tokens, self.mask_token, corrupt_rate=self.corrupt_rate,
                                               mask_frac=self.mask_frac, random_frac=self.random_frac,
                                               generator=generator)
        encoded, _ = vit.encode(vit.add_positions(tokens))
        logits = self.mpp_head(encoded[:, vit.config.num_prefix_tokens:])
        return logits, mpp_targets(images, vit.config.patch_size, self.bits), corrupted

    def loss(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Cross-entropy over the corrupted patches only."""
        logits, targets, corrupted = self(images, generator)
        return F.cross_entropy(logits[corrupted].float(), targets[corrupted])
