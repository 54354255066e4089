"""What the training stages log into their runs besides metrics: MLflow models and plots.

Models are logged from code (``training/mlflow_model.py``) with the safetensors weights as an
artifact, so loading one unpickles nothing. Plots are PNG artifacts under ``plots/`` that the
run page shows, drawn by :mod:`common.plots` as the report draws them.
"""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path
from typing import Any

from common import plots, tracking

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


def model_name(stage: str, variant: str, data: str) -> str:
    """The name a stage's model is logged under, e.g. ``pretrain-Ti16-imagenet21k``: MLflow's model
    list then says what each one is. Characters MLflow refuses in a name become ``-``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{stage}-{variant.replace('/', '')}-{data}").strip("-")


def log_vit_model(weights: str | Path, *, name: str, labels: list[str] | None = None, scores: str = "softmax",
                  metadata: dict[str, Any] | None = None):
    """Log ``weights`` (a vitcore safetensors checkpoint) as the active run's MLflow pyfunc model
    ``name`` (:func:`model_name`); vitcore goes with it as code, so the model loads without this
    project. ``scores`` is how its outputs read: ``softmax`` or ``sigmoid`` probabilities per class,
    in columns named by ``labels``, or ``features`` for a model without a classification head.
    Returns MLflow's ModelInfo (``model_uri`` for ``mlflow.pyfunc.load_model``)."""
    from vitcore.checkpoint import check_checkpoint

    config = check_checkpoint(weights)
    scores = "features" if not config.num_classes else scores
    names = [str(n) for n in labels or []]
    if len(names) != config.num_classes:  # unnamed classes are named by their index
        names = [str(i) for i in range(config.num_classes)]
    return tracking.log_model_from_code(
        MODEL_CODE, weights=weights, name=name, code_paths=[str(VITCORE)], pip_requirements=_requirements(),
        metadata={"labels": names, **(metadata or {})}, signature=model_signature(names, scores),
        model_config={"labels": names, "scores": scores},
    )


def model_signature(labels: list[str], scores: str):
    """The MLflow model's signature (:mod:`training.mlflow_model`): an ``image`` column in (file
    bytes or an HWC uint8 array per row); out, a probability column per class, or an ``(N, D)``
    float32 array of features for ``scores="features"``."""
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types.schema import AnyType, ColSpec, Schema, TensorSpec

    inputs = Schema([ColSpec(AnyType(), "image")])
    if scores == "features":
        return ModelSignature(inputs=inputs, outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, -1))]))
    return ModelSignature(inputs=inputs, outputs=Schema([ColSpec("float", name) for name in labels]))


def pretrain_curves(history: dict[str, list[tuple[int, float]]], path: Path, title: str = "") -> Path | None:
    """The run's curves (:func:`common.plots.pretrain_curves` of this one run) at ``path``; None when nothing was logged."""
    data = plots.pretrain_curves([("", history)], title)
    return None if data is None else plots.write(data, path)


def finetune_grid(trials: list[dict], selected_lr: float, final_test: float, path: Path, title: str = "") -> Path:
    """Dev (val) and test accuracy per learning rate of the selection sweep, the chosen rate marked, and the
    final retrain's test accuracy (:func:`common.plots.finetune_by_lr` of this one run) at ``path``."""
    entry = {"label": "", "trials": trials, "selected_lr": selected_lr, "test_accuracy": final_test}
    return plots.write(plots.finetune_by_lr([entry], title or "fine-tuning: accuracy per learning rate"), path)
