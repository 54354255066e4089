"""Ray Train pre-training on real shards: masked patch prediction, resume, schedules and errors."""
import json

import mlflow
import pytest

import vitcore
from vitscale import tracking
from vitscale.config import ConfigError
from vitscale.pretrain import PretrainConfig, effective_warmup, lr_at, run_pretrain


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
