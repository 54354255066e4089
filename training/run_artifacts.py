"""What the training stages log into their runs besides metrics: MLflow models and plots.

Models are logged from code (``training/mlflow_model.py``) with the safetensors weights as an
artifact, so loading one unpickles nothing. Plots are PNG artifacts under ``plots/`` that the
run page shows; matplotlib, as vitcore's inspection figures use.
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

MODEL_CODE = Path(__file__).with_name("mlflow_model.py")
VITCORE = Path(__file__).resolve().parents[1] / "vitcore"
PRETRAIN_CURVES = "plots/pretrain_curves.png"
FINETUNE_GRID = "plots/finetune_grid.png"


def _requirements() -> list[str]:
    out = []
    for dist in ("torch", "safetensors", "numpy", "pillow", "mlflow"):
        try:
            out.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(dist)
    return out


def log_vit_model(weights: str | Path, *, labels: list[str] | None = None, metadata: dict[str, Any] | None = None):
    """Log ``weights`` (a vitcore safetensors checkpoint) as the active run's MLflow pyfunc model
    ``model``; vitcore goes with it as code, so the model loads without this project. Returns
    MLflow's ModelInfo (``model_uri`` for ``mlflow.pyfunc.load_model``)."""
    from common import tracking

    return tracking.log_model_from_code(
        MODEL_CODE, weights=weights, code_paths=[str(VITCORE)], pip_requirements=_requirements(),
        metadata={"labels": list(labels or []), **(metadata or {})},
    )


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False  # run names and titles are text, never mathtext
    import matplotlib.pyplot as plt

    return plt


def pretrain_curves(history: dict[str, list[tuple[int, float]]], path: Path, title: str = "") -> Path | None:
    """Loss, learning rate, images/s and (when logged) few-shot and held-out accuracy against the step."""
    panels = [("loss", [k for k in ("train_loss", "holdout_loss") if k in history]),
              ("learning rate", [k for k in ("lr",) if k in history]),
              ("images / s", [k for k in ("images_per_second",) if k in history]),
              ("accuracy", [k for k in sorted(history) if k.startswith("fewshot_") or k in ("train_accuracy",
                                                                                             "holdout_accuracy")])]
    panels = [(label, keys) for label, keys in panels if keys]
    if not panels:
        return None
    plt = _plt()
    cols = min(2, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (label, keys) in zip(axes.flat, panels):
        for k in keys:
            steps, values = zip(*history[k])
            ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3, label=k)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if len(keys) > 1 or label == "accuracy":
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def finetune_grid(trials: list[dict], selected_lr: float, final_test: float, path: Path, title: str = "") -> Path:
    """Dev (val) and test accuracy per learning rate of the selection sweep, the chosen rate marked,
    and the final retrain's test accuracy."""
    plt = _plt()
    rows = sorted(trials, key=lambda r: r["lr"])
    lrs = [r["lr"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(lrs, [r["val_accuracy"] for r in rows], marker="o", label="dev (val) accuracy: selects the rate")
    ax.plot(lrs, [r["test_accuracy"] for r in rows], marker="s", linestyle="--", alpha=0.7,
            label="test accuracy of the selection trial (not used)")
    ax.scatter([selected_lr], [final_test], marker="*", s=180, color="crimson", zorder=5,
               label=f"final: lr={selected_lr:g} on all of train, test {final_test:.3f}")
    if len(lrs) > 1 and min(lrs) > 0:
        ax.set_xscale("log")
    ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs])
    ax.set_xlabel("learning rate")
    ax.set_ylabel("top-1 accuracy")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    ax.set_title(title or "fine-tuning: accuracy per learning rate", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
