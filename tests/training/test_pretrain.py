"""Ray Train pre-training on real shards: masked patch prediction, resume, schedules and errors."""
import json

import numpy as np

import mlflow
import pytest

import vitcore
from common import tracking
from common.config import ConfigError
from training.pretrain import PretrainConfig, run_pretrain
from training.loop import effective_warmup, lr_at


def test_schedule_warms_up_then_decays():
    lrs = [lr_at(s, total=100, warmup=10, peak=1.0, schedule="linear") for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] < 0.02
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    cos = [lr_at(s, total=100, warmup=0, peak=1.0, schedule="cosine") for s in (0, 50, 99)]
    assert cos[0] == pytest.approx(1.0) and cos[1] == pytest.approx(0.5, abs=0.02) and cos[2] < 0.01
    assert effective_warmup(10_000, 200) == 20


def test_missing_shards_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="has no manifest.json; run jobs/prepare.py"):
        run_pretrain(PretrainConfig(data=str(tmp_path / "nowhere"), output=str(tmp_path / "o")))


def test_too_few_rows_for_one_batch_is_refused_before_ray_starts(small_demo, tmp_path):
    shards = small_demo["work"] / "shards" / "corpus"
    with pytest.raises(ConfigError, match=r"training rows cannot fill one batch of 50000 per worker on 2 workers"):
        run_pretrain(PretrainConfig(data=str(shards), output=str(tmp_path / "o"), batch_size=100_000, num_workers=2))
    assert not (tmp_path / "o" / "ray").exists()  # refused before Ray Train made its run folder


def test_mpp_objective_trains_and_saves_a_backbone(small_demo, tmp_path):
    shards = small_demo["work"] / "shards" / "corpus"
    cfg = PretrainConfig(
        data=str(shards), output=str(tmp_path / "mpp"), variant="Ti/8", depth=1, img_size=32, epochs=1,
        batch_size=32, num_workers=1, objective="mpp", warmup_steps=2, run_name="mpp-test",
    )
    summary = run_pretrain(cfg)
    assert summary["objective"] == "mpp"
    # 512 colour classes: a loss near ln(512) ≈ 6.24 at the start, finite after training.
    assert 0 < summary["metrics"]["train_loss"] < 7.0
    model = vitcore.load_checkpoint(summary["model"])
    assert model.config.depth == 1 and model.config.img_size == (32, 32)


def test_rerun_resumes_from_the_last_checkpoint(small_demo, tmp_path):
    shards = small_demo["work"] / "shards" / "corpus"
    base = dict(data=str(shards), output=str(tmp_path / "resume"), variant="Ti/8", depth=1, img_size=32,
                batch_size=32, num_workers=1, warmup_steps=2, run_name="resume-test")
    first = run_pretrain(PretrainConfig(epochs=1, **base))
    second = run_pretrain(PretrainConfig(epochs=2, **base))
    assert second["metrics"]["epoch"] == 1
    # The second run continued the step count instead of starting over.
    assert second["metrics"]["step"] == 2 * first["metrics"]["step"]
    run = mlflow.MlflowClient(tracking.tracking_uri()).get_run(second["mlflow_run_id"])
    assert run.data.params["epochs"] == "2"
    assert json.loads((tmp_path / "resume" / "pretrain_summary.json").read_text())["metrics"]["epoch"] == 1


def test_ray_data_loader_streams_the_same_split(small_demo, tmp_path):
    from pipelines.schema import ShardSet
    from training.data import holdout_mask, shard_keys

    shards = small_demo["work"] / "shards" / "corpus"
    cfg = PretrainConfig(
        data=str(shards), output=str(tmp_path / "rd"), variant="Ti/8", depth=1, img_size=32, epochs=1,
        batch_size=16, num_workers=2, loader="ray_data", holdout=0.2, warmup_steps=2, run_name="ray-data-test",
    )
    summary = run_pretrain(cfg)
    n_train = int((~holdout_mask(shard_keys(ShardSet(str(shards))), 0.2)).sum())
    # Both workers took the same number of full batches from an equal split of the training rows.
    assert summary["metrics"]["step"] == n_train // 2 // 8
    assert 0.0 <= summary["metrics"]["holdout_accuracy"] <= 1.0


def test_ray_data_loader_refuses_a_layout_that_would_stall(small_demo, tmp_path):
    shards = small_demo["work"] / "shards" / "corpus"
    cfg = PretrainConfig(data=str(shards), output=str(tmp_path / "stall"), num_workers=4, loader="ray_data",
                         batch_size=16)  # rows enough for a step, so the layout is what gets refused
    with pytest.raises(ConfigError, match="loader: ray_data needs CPUs for its data tasks"):
        run_pretrain(cfg)


def test_holdout_split_depends_on_keys_only():
    from training.data import holdout_mask

    keys = [f"{i:020x}" for i in range(5000)]
    mask = holdout_mask(keys, 0.1)
    assert 400 < mask.sum() < 600
    assert np.array_equal(mask, holdout_mask(list(keys), 0.1))
    assert np.array_equal(mask[::-1], holdout_mask(keys[::-1], 0.1))


def test_resuming_under_a_different_recipe_is_refused():
    from training.pretrain import check_resumable

    saved = {"lr": 0.001, "epochs": 1, "holdout": 0.02, "run_name": "r"}
    check_resumable(saved, {**saved, "epochs": 5})  # more epochs: fine
    with pytest.raises(ConfigError, match="holdout: checkpoint 0.02, now 0.1"):
        check_resumable(saved, {**saved, "holdout": 0.1})
