"""The worked recipes in configs/: each parses through the pre-training job's config path and runs
for 2 steps on the CPU at tiny scale, its model and regularizers overridden from the command line
as a user would shrink it."""
from pathlib import Path

import numpy as np
import pytest

import vitcore
from common.config import parse_args
from training.pretrain import PretrainConfig, run_pretrain

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHRINK = ["--variant", "Ti/8", "--depth", "1", "--img-size", "32", "--batch-size", "4", "--microbatch", "4",
          "--steps", "2", "--warmup-steps", "1", "--num-workers", "1", "--cpus-per-worker", "1", "--use-gpu", "false",
          "--holdout", "0.2", "--checkpoint-every", "2", "--log-every", "1"]
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


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_runs_two_steps_on_the_cpu_at_tiny_scale(name, tiny_shards, tmp_path, mlflow_store, ray_session):
    argv = ["--config", str(CONFIGS / name), "--data", str(tiny_shards), "--output", str(tmp_path / "out"), *SHRINK]
    cfg = parse_args(PretrainConfig, argv, prog="pretrain")
    summary = run_pretrain(cfg)
    assert summary["steps"] == 2 and np.isfinite(summary["metrics"]["train_loss"])
    model_cfg = vitcore.read_checkpoint(summary["model"])[0]
    assert (model_cfg.classifier, model_cfg.posemb) == (cfg.classifier, cfg.posemb)
