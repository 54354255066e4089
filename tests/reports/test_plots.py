"""Plot text is shown as written: a `$` in a run name or title is not mathtext."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from reports import plots
from reports.store import Run
from training import run_artifacts

# Unbalanced mathtext: matplotlib raises on it when math parsing is on.
NAME = r"run $\frac{1$ costs"


def _run(name: str) -> Run:
    return Run(id="0123456789abcdef", name=name, stage="pretrain", experiment="e", status="FINISHED", start=0,
               end=1, params={}, metrics={}, tags={})


def test_the_reports_plots_survive_a_dollar_in_a_run_name():
    curves = {"0123456789abcdef": {"train_loss": [(0, 2.0), (10, 1.0)], "holdout_accuracy": [(10, 0.5)]}}
    png = plots.pretrain_curves([_run(NAME)], curves)
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and np.asarray(image.convert("L")).std() > 10


def test_a_runs_own_plots_survive_a_dollar_in_their_title(tmp_path):
    path = run_artifacts.pretrain_curves({"train_loss": [(0, 2.0), (10, 1.0)]}, tmp_path / "c.png", title=NAME)
    assert Image.open(path).format == "PNG"
    path = run_artifacts.finetune_grid([{"lr": 0.01, "val_accuracy": 0.5, "test_accuracy": 0.4}], 0.01, 0.4,
                                       tmp_path / "g.png", title=NAME)
    assert Image.open(path).format == "PNG"
