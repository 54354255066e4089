"""A study's Figures 4 and 5, drawn from a hand-made table (no training)."""
from __future__ import annotations

import io

import numpy as np
from PIL import Image

from common import plots
from reports import study

# Two models (a ViT and a BiT ResNet) at three fractions, 5- and 10-shot; one cell unscored.
ROWS = [
    {"model": m, "fraction": f, "images": int(800 * f), "steps": int(100 * f), "exaflops": x * f,
     "best_step": 10, "mlflow_run_id": "r", "5shot_accuracy": a * f ** 0.2, "5shot_step": 10,
     "10shot_accuracy": a * f ** 0.1 if f < 1 or m != "BiT-mu" else None, "10shot_step": 10}
    for m, x, a in (("Ti/8", 2e-6, 0.5), ("BiT-mu", 5e-6, 0.6)) for f in (0.25, 0.5, 1.0)
]


def rgb(png: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB"))


def has_colour(pixels: np.ndarray, colour) -> bool:
    want = np.round(np.array(colour[:3]) * 255)
    return bool((np.abs(pixels.astype(int) - want).max(axis=-1) <= 2).any())


def test_both_figures_draw_each_model_in_its_colour_one_panel_per_shot_count():
    figs = study.figures(ROWS)
    assert set(figs) == {"study_accuracy_by_images.png", "study_accuracy_by_exaflops.png"}
    one_shot = study.figures([{k: v for k, v in r.items() if not k.startswith("10shot")} for r in ROWS])
    for name, png in figs.items():
        pixels = rgb(png)
        # Two panels (5- and 10-shot) side by side: wider than the one-panel figure.
        assert pixels.shape[1] > 1.6 * rgb(one_shot[name]).shape[1], name
        for colour in plots.colours(2):
            assert has_colour(pixels, colour), (name, colour)


def test_families_follow_the_variant_names():
    assert [plots.model_family(m) for m in ("Ti/16", "B/32", "BiT-R50x1", "BiT-mu", "R50+B/16", "R26+S/32")] == \
        ["ViT", "ViT", "ResNet", "ResNet", "hybrid", "hybrid"]


def test_a_table_without_few_shot_scores_draws_nothing():
    bare = [{k: v for k, v in r.items() if "shot" not in k} for r in ROWS]
    assert study.figures(bare) == {name: None for name in study.FIGURES}
    assert study.figures([{**r, "5shot_accuracy": None, "10shot_accuracy": None} for r in ROWS]) == \
        {name: None for name in study.FIGURES}

