"""Mixup and CutMix of a whole batch, on whatever device the batch is on (DeiT, AugReg).

Each batch is mixed with itself reversed: image i with image B-1-i. Mixup blends the two images
and their targets with λ ~ Beta(α, α) (Zhang et al. 2018). CutMix pastes a box of the partner
into each image (Yun et al. 2019); the box covers about 1-λ of the image, and λ is then set to
the area the box leaves, clipped at the borders, so the targets weigh what the pixels show. With
both on, one of the two is drawn per batch, CutMix with ``switch_prob``, as timm's ``Mixup`` does.

Every random choice comes from a generator seeded by the run's seed and the batch's place in
the schedule (step, rank, micro-batch), not from a stream: a resumed run mixes its next batch
exactly as the run that was not interrupted did.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from training.losses import one_hot


@dataclass(frozen=True)
class MixDraw:
    """One batch's choice: ``cutmix`` or mixup, the targets' weight ``lam`` of the image itself,
    and the CutMix box ``(y0, y1, x0, x1)`` in pixels (None for mixup)."""

    cutmix: bool
    lam: float
    box: tuple[int, int, int, int] | None = None


@dataclass(frozen=True)
class Mixer:
    """Mixup (``mixup`` α) and CutMix (``cutmix`` α) of pre-training batches; α 0 turns one off."""

    mixup: float = 0.0
    cutmix: float = 0.0
    switch_prob: float = 0.5
    seed: int = 0

    @property
    def on(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0

    def draw(self, height: int, width: int, key: tuple[int, ...]) -> MixDraw:
        """The mix of the batch at ``key`` (step, rank, micro-batch) of images ``height`` x ``width``."""
        rng = np.random.default_rng([self.seed, *key])
        use_cutmix = self.cutmix > 0 and (self.mixup <= 0 or rng.random() < self.switch_prob)
        lam = float(rng.beta(*(2 * [self.cutmix if use_cutmix else self.mixup])))
        if not use_cutmix:
            return MixDraw(False, lam)
        box = cutmix_box(height, width, lam, rng)
        y0, y1, x0, x1 = box
        return MixDraw(True, 1.0 - (y1 - y0) * (x1 - x0) / (height * width), box)

    def __call__(self, x: torch.Tensor, targets: torch.Tensor, num_classes: int,
                 key: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mixed images, soft targets (B, C)) of images (B, C, H, W) and class ids or (B, C) targets."""
        mix = self.draw(x.shape[-2], x.shape[-1], key)
        return mix_images(x, mix), mix_targets(one_hot(targets, num_classes), mix.lam)


def cutmix_box(height: int, width: int, lam: float, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """A box of sides sqrt(1-λ) times the image's, centred uniformly at random and clipped to the
    image: (y0, y1, x0, x1), end-exclusive."""
    ratio = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * ratio), int(width * ratio)
    cy, cx = int(rng.integers(0, height)), int(rng.integers(0, width))
    y0, y1 = max(0, cy - cut_h // 2), min(height, cy + cut_h // 2)
    x0, x1 = max(0, cx - cut_w // 2), min(width, cx + cut_w // 2)
    return y0, y1, x0, x1


def mix_images(x: torch.Tensor, mix: MixDraw) -> torch.Tensor:
    partner = x.flip(0)
    if not mix.cutmix:
        return x * mix.lam + partner * (1.0 - mix.lam)
    y0, y1, x0, x1 = mix.box
    out = x.clone()
    out[..., y0:y1, x0:x1] = partner[..., y0:y1, x0:x1]
    return out


def mix_targets(targets: torch.Tensor, lam: float) -> torch.Tensor:
    return targets * lam + targets.flip(0) * (1.0 - lam)
