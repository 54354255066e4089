"""What the training stages log besides metrics: their plots are the report's figures, given one run."""
from __future__ import annotations

from common import plots
from training import run_artifacts

HISTORY = {"train_loss": [(1, 2.0), (2, 1.5), (3, 1.2)], "lr": [(1, 0.1), (2, 0.05), (3, 0.01)],
           "holdout_accuracy": [(3, 0.4)]}
TRIALS = [{"lr": 0.01, "val_accuracy": 0.5, "test_accuracy": 0.45}, {"lr": 0.1, "val_accuracy": 0.7, "test_accuracy": 0.6}]


def test_one_run_is_the_many_run_figure_given_that_run(tmp_path):
    path = run_artifacts.pretrain_curves(HISTORY, tmp_path / "plots" / "curves.png", title="a run")
    assert path.read_bytes() == plots.pretrain_curves([("", HISTORY)], "a run")
    grid = run_artifacts.finetune_grid(TRIALS, 0.1, 0.6, tmp_path / "grid.png", title="a sweep")
    assert grid.read_bytes() == plots.finetune_by_lr(
        [{"label": "", "trials": TRIALS, "selected_lr": 0.1, "test_accuracy": 0.6}], "a sweep")


def test_a_runs_own_plots_survive_a_dollar_in_their_title(tmp_path):
    name = r"run $\frac{1$ costs"  # unbalanced mathtext: matplotlib raises on it when math parsing is on
    assert run_artifacts.pretrain_curves(HISTORY, tmp_path / "c.png", title=name).read_bytes()[:4] == b"\x89PNG"
    assert run_artifacts.finetune_grid(TRIALS, 0.1, 0.6, tmp_path / "g.png", title=name).read_bytes()[:4] == b"\x89PNG"
