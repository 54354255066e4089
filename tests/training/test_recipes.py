"""The worked recipes in configs/: each parses through the pre-training job's config path into the
settings its source uses."""
from pathlib import Path

import pytest

from common.config import parse_args
from training.pretrain import PretrainConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = {
    "pretrain-s16-i1k.yaml": dict(variant="S/16", classifier="gap", posemb="sincos2d", randaug=[2, 10], mixup=0.2,
                                  batch_size=1024, epochs=90),
    "pretrain-b16-i1k-augreg.yaml": dict(variant="B/16", randaug=[2, 15], mixup=0.5, dropout=0.1, drop_path=0.1,
                                         loss="sigmoid"),
    "pretrain-b16-i1k-deit.yaml": dict(variant="B/16", label_smoothing=0.1, drop_path=0.1, randaug=[2, 9], mixup=0.8,
                                       cutmix=1.0, ema_decay=0.99996),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_says_what_its_source_does(name):
    cfg = parse_args(PretrainConfig, ["--config", str(CONFIGS / name), "--data", "d"], prog="pretrain")
    for field, value in RECIPES[name].items():
        assert getattr(cfg, field) == value, field

