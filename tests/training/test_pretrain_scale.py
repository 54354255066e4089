"""Pre-training at scale on real Ray: accumulation, step checkpoints, resume, strategies, metrics."""
import json
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch

import vitcore
from common import tracking
from training.checkpointer import TRAIN_STATE
from training.pretrain import PretrainConfig, run_pretrain
from training.trainer import epoch_rows

TINY = dict(variant="Ti/8", depth=1, img_size=32, num_workers=1, warmup_steps=2, holdout=0.1, log_every=2)


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "30", "--num-workers", "4"], "batch_size: the global batch 30 does not split evenly over 4 workers"),
    (["--batch-size", "32", "--num-workers", "2", "--microbatch", "5"], "microbatch: 5 does not divide the per-worker batch 16"),
    (["--checkpoint-every", "0"], "checkpoint_every: must be a positive integer, got 0"),
    (["--strategy", "zero3"], "strategy: expected one of 'ddp', 'fsdp'"),
])
def test_bad_config_fails_before_any_worker_starts(args, message, tmp_path, job_main):
    out = job_main("pretrain", "--data", str(tmp_path), *args)  # run in tmp_path
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and message in out.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "pretrain_output").exists()


def test_epoch_rows_deal_a_permutation_without_overlap():
    parts = [epoch_rows(103, 4, r, seed=1, epoch=2) for r in range(4)]
    flat = [int(i) for p in parts for i in p]
    assert len(flat) == 100 and len(set(flat)) == 100
    assert not all((a == b).all() for a, b in zip(parts, [epoch_rows(103, 4, r, seed=1, epoch=3) for r in range(4)]))


@pytest.fixture(scope="module")
def shards(small_demo):
    return small_demo["work"] / "shards"


def test_step_resume_gives_the_uninterrupted_parameters(shards, tmp_path, mlflow_store):
    base = dict(data=str(shards / "corpus"), steps=6, batch_size=8, microbatch=4, checkpoint_every=2, dropout=0.1, **TINY)
    whole = run_pretrain(PretrainConfig(output=str(tmp_path / "whole"), run_name="whole", keep_checkpoints=1,
                                        fewshot_every=3, fewshot_data=str(shards / "digits-train"),
                                        register_as="tiny-test", **base))
    first = run_pretrain(PretrainConfig(output=str(tmp_path / "split"), run_name="split", stop_after=3, **base))
    assert first["steps"] == 3 and first["data_position"]["offset"] == 3
    second = run_pretrain(PretrainConfig(output=str(tmp_path / "split"), run_name="split", **base))
    assert whole["steps"] == second["steps"] == 6 and whole["restarts"] == second["restarts"] == 0
    a, b = vitcore.load_checkpoint(whole["model"]), vitcore.load_checkpoint(second["model"])
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
    # The same rows in the same epoch position, counted from the restored checkpoint onwards.
    assert whole["data_position"] == second["data_position"]

    # The training state is tensors and plain types only: it loads with weights_only=True, and
    # its model loads into vitcore alone.
    ckpt = Path(whole["checkpoint"])
    state = torch.load(ckpt / TRAIN_STATE, weights_only=True)
    assert state["step"] == 6 and set(state["rng"]) >= {"cpu"} and "optimizer" in state
    plain = vitcore.load_checkpoint(ckpt / "model.safetensors")
    plain.load_state_dict(state["model"])
    # keep_checkpoints=1: only the last one is left.
    assert len([p for p in ckpt.parent.iterdir() if p.is_dir() and p.name.startswith("checkpoint_")]) == 1

    client = mlflow.MlflowClient(tracking.tracking_uri())
    run = client.get_run(whole["mlflow_run_id"])
    for name in ("train_loss", "lr", "grad_norm", "images_per_second", "images_per_second_per_worker",
                 "input_wait_fraction", "restarts", "steps"):
        assert name in run.data.metrics, name
    assert 0.0 <= run.data.metrics["input_wait_fraction"] <= 1.0
    assert any(k.startswith("fewshot_") and k.endswith("shot_accuracy") for k in run.data.metrics), run.data.metrics
    assert len(client.get_metric_history(run.info.run_id, "grad_norm")) == 3  # log_every=2 over 6 steps
    # One meaning per key: the step lines' loss every log_every steps; every rank's since each checkpoint apart.
    def steps(key):
        return sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
    assert steps("train_loss") == steps("images_per_second") == [2, 4, 6]
    assert steps("checkpoint_train_loss") == steps("checkpoint_images_per_second") == [2, 4, 6]
    figures = {f.path for f in client.list_artifacts(run.info.run_id, "inspection")}
    assert figures == {"inspection/embedding_filters.png", "inspection/position_embedding_similarity.png",
                       "inspection/mean_attention_distance.png"}
    (version,) = client.search_model_versions("name='tiny-test'")
    assert version.run_id == run.info.run_id
    manifest = json.loads((shards / "corpus" / "manifest.json").read_text())
    assert version.tags["vitscale.data_manifest_sha256"] and manifest["shards"]
    assert json.loads(version.tags["vitscale.model_config"])["depth"] == 1
    # The registered version is the run's MLflow model: it loads (no pickle) and predicts.
    registered = mlflow.pyfunc.load_model(f"models:/tiny-test/{version.version}")
    assert registered.predict({"image": list(np.zeros((2, 40, 40, 3), dtype=np.uint8))}).shape[0] == 2
    # The curves plot has the few-shot accuracy panel's data, and the model its lineage record.
    assert "plots/pretrain_curves.png" in {f.path for f in client.list_artifacts(run.info.run_id, "plots")}
    assert json.loads((tmp_path / "whole" / "lineage.json").read_text())["run_id"] == run.info.run_id


def test_step_resume_on_the_device_augment_path_gives_the_uninterrupted_parameters(shards, tmp_path, mlflow_store):
    # The crop boxes, RandAugment's ops, Mixup/CutMix's draws and stochastic depth's drops come from
    # generators keyed by the step and row, and EMA is in the checkpoint: a resume redraws them exactly.
    base = dict(data=str(shards / "corpus"), steps=6, batch_size=8, microbatch=4, checkpoint_every=2, dropout=0.1,
                augment="device", randaug=[2, 15], mixup=0.5, cutmix=1.0, drop_path=0.1, ema_decay=0.9,
                **{**TINY, "depth": 2})
    whole = run_pretrain(PretrainConfig(output=str(tmp_path / "whole"), run_name="whole", **base))
    first = run_pretrain(PretrainConfig(output=str(tmp_path / "split"), run_name="split", stop_after=3, **base))
    assert first["steps"] == 3
    second = run_pretrain(PretrainConfig(output=str(tmp_path / "split"), run_name="split", **base))
    assert whole["steps"] == second["steps"] == 6
    a, b = vitcore.load_checkpoint(whole["model"]), vitcore.load_checkpoint(second["model"])
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
    assert whole["data_position"] == second["data_position"]


def test_fsdp_checkpoint_continues_under_ddp(shards, tmp_path, mlflow_store):
    base = dict(data=str(shards / "corpus"), output=str(tmp_path / "fsdp"), run_name="fsdp", steps=4, batch_size=8,
                checkpoint_every=2, **{**TINY, "num_workers": 2})
    sharded = run_pretrain(PretrainConfig(strategy="fsdp", stop_after=2, **base))
    assert sharded["steps"] == 2
    state = torch.load(Path(sharded["checkpoint"]) / TRAIN_STATE, weights_only=True)
    vitcore.load_checkpoint(Path(sharded["checkpoint"]) / "model.safetensors").load_state_dict(state["model"])
    replicated = run_pretrain(PretrainConfig(strategy="ddp", **base))
    assert replicated["steps"] == 4 and replicated["metrics"]["train_loss"] > 0
