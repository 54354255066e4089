"""The classification loss every training stage uses: a softmax or sigmoid head, hard or soft targets.

Targets are class ids (B,) or a (B, C) matrix: multi-hot labels of a multi-label corpus, or the
soft targets of Mixup and CutMix (:mod:`training.mixup`). A (B, C) matrix alone does not say
which head it is for, so callers name the head; without one, (B, C) reads as sigmoid, (B,) as
softmax (how the held-out and fine-tuning labels come).

Label smoothing (Section 4.3 lists it among the regularizers tuned on the smaller datasets)
mixes each softmax target with the uniform distribution: ``(1 - ε) t + ε / C``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

HEADS = ("softmax", "sigmoid")


def classification_loss(logits: torch.Tensor, targets: torch.Tensor, *, head: str | None = None,
                        label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, number correct) of ``logits`` against ``targets``.

    Args:
        logits: (B, C) scores.
        targets: (B,) class ids, or (B, C) multi-hot or soft targets.
        head: "softmax" or "sigmoid"; None infers it from the targets' shape (see the module).
        label_smoothing: ε of softmax label smoothing; 0 leaves the loss as it was.

    A prediction counts as correct when its top class is the target's top class (softmax) or
    one of the image's labels (sigmoid).
    """
    head = head or ("sigmoid" if targets.ndim == 2 else "softmax")
    if head not in HEADS:
        raise ValueError(f"head {head!r}: use one of {', '.join(HEADS)}")
    logits = logits.float()
    if head == "sigmoid":
        if label_smoothing:
            raise ValueError("label smoothing applies to the softmax loss; use head='softmax' or 0")
        if targets.ndim == 1:
            targets = F.one_hot(targets, logits.shape[1]).float()
        loss = F.binary_cross_entropy_with_logits(logits, targets.float(), reduction="sum")
        correct = (targets.gather(1, logits.argmax(1, keepdim=True)) > 0).sum()
        return loss, correct
    if targets.ndim == 1:
        # The hard-label path as it always was (label_smoothing=0 is bit-identical to plain cross-entropy).
        loss = F.cross_entropy(logits, targets, reduction="sum", label_smoothing=label_smoothing)
        return loss, (logits.argmax(1) == targets).sum()
    targets = targets.float()
    if label_smoothing:
        targets = targets * (1.0 - label_smoothing) + label_smoothing / logits.shape[1]
    loss = -(targets * F.log_softmax(logits, dim=1)).sum()
    return loss, (logits.argmax(1) == targets.argmax(1)).sum()


def one_hot(targets: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(B, C) float targets: class ids one-hot, a (B, C) matrix as it is."""
    if targets.ndim == 2:
        return targets.float()
    return F.one_hot(targets.long(), num_classes).float()
