"""Few-shot linear evaluation (Section 4.1, "Metrics").

"Few-shot accuracies are obtained by solving a regularized least-squares regression
problem that maps the (frozen) representation of a subset of training images to
{-1, 1}^K target vectors." The recipe follows big_vision's fewshot_lsr evaluator:
whiten each feature, append a constant bias feature of 100 (large, so the bias is
almost unregularised), and solve through an eigendecomposition in the primal form
when N >= D and the dual form otherwise, with l2 = 2^10.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

BIAS_CONSTANT = 100.0
DEFAULT_L2 = 2.0 ** 10
DEFAULT_SHOTS = (1, 5, 10, 25)
DEFAULT_SEEDS = (0, 1, 2)


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x)


@dataclass
class RidgeClassifier:
    mean: np.ndarray
    std: np.ndarray
    weights: np.ndarray  # (D + 1, K)

    def _design(self, x: np.ndarray) -> np.ndarray:
        x = (x - self.mean) / self.std
        return np.pad(x, ((0, 0), (0, 1)), constant_values=BIAS_CONSTANT)

    def scores(self, x) -> np.ndarray:
        return self._design(_np(x).astype(np.float64)) @ self.weights

    def predict(self, x) -> np.ndarray:
        return self.scores(x).argmax(axis=1)


def fit_ridge(x, y, num_classes: int, l2_reg: float = DEFAULT_L2, form: str = "auto") -> RidgeClassifier:
    """Closed-form regularised least squares from features (N, D) to 2*onehot(y)-1.

    Primal: w = (X^T X + l2 I)^-1 X^T Y, an eigendecomposition of the D x D Gram matrix.
    Dual:   w = X^T (X X^T + l2 I)^-1 Y, of the N x N one; cheaper when D > N, which is
    the usual few-shot case (K * shots images, D = 768 or more features).
    """
    x = _np(x).astype(np.float64)
    y = _np(y).astype(np.int64)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ValueError(f"fit_ridge expects features (N, D) and labels (N,), got {x.shape} and {y.shape}")
    if y.min() < 0 or y.max() >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{y.min()}, {y.max()}]")
    mean = x.mean(axis=0, keepdims=True)
    std = x.std(axis=0, keepdims=True) + 1e-5
    clf = RidgeClassifier(mean, std, np.empty(0))
    xd = clf._design(x)
    targets = 2.0 * np.eye(num_classes)[y] - 1.0
    n, d = xd.shape
    if form == "auto":
        form = "primal" if n >= d else "dual"
    if form == "primal":
        eigs, q = np.linalg.eigh(xd.T @ xd)
        clf.weights = q @ ((q.T @ (xd.T @ targets)) / (eigs + l2_reg)[:, None])
    elif form == "dual":
        eigs, q = np.linalg.eigh(xd @ xd.T)
        clf.weights = xd.T @ (q @ ((q.T @ targets) / (eigs + l2_reg)[:, None]))
    else:
        raise ValueError(f"form={form!r}; use 'auto', 'primal' or 'dual'")
    return clf


def select_shots(labels, shots: int, seed: int, num_classes: int | None = None) -> np.ndarray:
    """Indices of `shots` random examples per class (every class must have enough)."""
    labels = _np(labels).astype(np.int64)
    num_classes = int(labels.max()) + 1 if num_classes is None else num_classes
    rng = np.random.default_rng(seed)
    picked = []
    for c in range(num_classes):
        idx = np.flatnonzero(labels == c)
        if len(idx) < shots:
            raise ValueError(f"class {c} has {len(idx)} training examples, fewer than {shots} shots; "
                             f"use fewer shots or a larger training pool")
        picked.append(rng.choice(idx, size=shots, replace=False))
    return np.concatenate(picked)


def fewshot_accuracy(train_x, train_y, test_x, test_y, *, num_classes: int | None = None,
                     shots: Sequence[int] = DEFAULT_SHOTS, seeds: Sequence[int] = DEFAULT_SEEDS,
                     l2_reg: float = DEFAULT_L2) -> dict[int, dict[str, float | list[float]]]:
    """Accuracy of the closed-form classifier for each shot count, over several seeds.

    Returns {shots: {"mean": ..., "std": ..., "per_seed": [...]}}.
    """
    train_x, test_x = _np(train_x), _np(test_x)
    train_y, test_y = _np(train_y).astype(np.int64), _np(test_y).astype(np.int64)
    if num_classes is None:
        num_classes = int(max(train_y.max(), test_y.max())) + 1
    results = {}
    for k in shots:
        accs = []
        for seed in seeds:
            idx = select_shots(train_y, k, seed, num_classes)
            clf = fit_ridge(train_x[idx], train_y[idx], num_classes, l2_reg)
            accs.append(float((clf.predict(test_x) == test_y).mean()))
        results[k] = {"mean": float(np.mean(accs)), "std": float(np.std(accs)), "per_seed": accs}
    return results


@torch.no_grad()
def compute_representations(model: torch.nn.Module, batches: Iterable[torch.Tensor] | torch.Tensor, *,
                            key: str = "pre_logits", batch_size: int = 256) -> np.ndarray:
    """Frozen features of a model for few-shot evaluation: `model(x, return_intermediates=True)`
    and take `key` ("pre_logits" by default, as big_vision)."""
    if isinstance(batches, torch.Tensor):
        batches = batches.split(batch_size)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    feats = []
    try:
        for x in batches:
            _, out = model(x.to(device), return_intermediates=True)
            if key not in out:
                raise KeyError(f"representation {key!r} not produced; available: {', '.join(out)}")
            feats.append(out[key].float().cpu().numpy())
    finally:
        model.train(was_training)
    return np.concatenate(feats)
