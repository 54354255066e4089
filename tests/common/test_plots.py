"""The figures of the stages and the report: PNGs for one run or many, whatever the runs are named."""
from __future__ import annotations

import io

from PIL import Image

from common import plots

HISTORY = {"train_loss": [(1, 2.0), (2, 1.5), (3, 1.2)], "lr": [(1, 0.1), (2, 0.05), (3, 0.01)],
           "images_per_second": [(1, 90.0), (2, 110.0), (3, 105.0)], "holdout_accuracy": [(3, 0.4)],
           "fewshot_digits_5shot_accuracy": [(3, 0.3)]}
TRIALS = [{"lr": 0.01, "val_accuracy": 0.5, "test_accuracy": 0.45}, {"lr": 0.1, "val_accuracy": 0.7, "test_accuracy": 0.6}]


def image(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    assert img.format == "PNG"
    return img


def test_a_run_name_with_a_dollar_sign_plots_as_text():
    """mathtext would read ``$\\frac{1$`` as an unfinished formula and fail the whole report."""
    name = r"run $\frac{1$ costs"
    assert image(plots.pretrain_curves([(name, HISTORY)], title=name))
    assert image(plots.finetune_by_lr([{"label": name, "trials": TRIALS, "selected_lr": 0.1, "test_accuracy": 0.6}],
                                      name))
    assert image(plots.vtab_bars([{"label": name, "tasks": {"dsprites": {"group": "structured", "test_accuracy": 0.5}},
                                   "groups": {"structured": 0.5}, "mean": 0.5}]))
    assert image(plots.dedup_bars([{"label": name, "counts": {"t": 3}}], ["t"]))


def test_a_run_without_curves_has_no_figure(tmp_path):
    assert plots.pretrain_curves([("a", {}), ("b", {"train_loss": []})]) is None
    assert plots.finetune_by_lr([{"label": "a", "trials": [{"lr": 0.1, "val_accuracy": None}]}], "t") is None
    assert plots.dedup_bars([{"label": "a", "counts": {}}], ["t"]) is None
