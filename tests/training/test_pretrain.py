"""Ray Train pre-training on real shards: masked patch prediction, resume, schedules and errors."""
import json
from pathlib import Path

import mlflow
import numpy as np
import pytest

import vitcore
from common import tracking
from common.config import ConfigError
from training.pretrain import PretrainConfig, run_pretrain


def test_missing_shards_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"has no manifest.json; this is not a shard set or the prepare run did not complete; run jobs/prepare.py --input SOURCE --output "):
        run_pretrain(PretrainConfig(data=str(tmp_path / "nowhere"), output=str(tmp_path / "o")))


def test_too_few_rows_for_one_batch_is_refused_before_ray_starts(small_demo, tmp_path):
    shards = small_demo["work"] / "shards" / "corpus"
    with pytest.raises(ConfigError, match=r"training rows cannot fill one batch of 50000 per worker on 2 workers"):
        run_pretrain(PretrainConfig(data=str(shards), output=str(tmp_path / "o"), batch_size=100_000, num_workers=2))
    assert not (tmp_path / "o" / "ray").exists()  # refused before Ray Train made its run folder


def test_an_unlabelled_set_with_the_classification_objective_is_refused_before_ray(unlabelled_shards, tiny_shards,
                                                                                   tmp_path):
    # It used to fail inside a worker, suggesting label_mode='multi', which is no flag.
    import ray

    ray_was_up = ray.is_initialized()
    with pytest.raises(ConfigError, match=r"data: .* is unlabelled \(none of its 16 rows has a label\); "
                                          r"pre-train an unlabelled set with --objective mpp"):
        run_pretrain(PretrainConfig(data=str(unlabelled_shards), output=str(tmp_path / "o"), batch_size=4))
    with pytest.raises(ConfigError, match=r"fewshot_data: .* is unlabelled"):
        run_pretrain(PretrainConfig(data=str(tiny_shards), output=str(tmp_path / "o"), batch_size=4,
                                    fewshot_data=str(unlabelled_shards), fewshot_every=10))
    assert ray.is_initialized() == ray_was_up and not (tmp_path / "o" / "ray").exists()


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
    # Ray started in-process runs Ray Train for one node: no preemption watcher, a process per fit.
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    actors = {line for p in logs.glob("worker-*.out") for line in p.read_text(errors="replace").splitlines()
              if line.startswith(":actor_name:")}
    assert ":actor_name:TrainController" in actors and ":actor_name:PreemptionWatcher" not in actors, actors


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
    # The held-out rows were evaluated (what a model learns is tests/training/test_loop.py's to check).
    assert np.isfinite(summary["metrics"]["holdout_loss"]) and "holdout_accuracy" in summary["metrics"]


def test_ray_data_loader_trains_on_device_augmented_crops(small_demo, tmp_path):
    shards = small_demo["work"] / "shards" / "corpus"
    cfg = PretrainConfig(
        data=str(shards), output=str(tmp_path / "rd-device"), variant="Ti/8", depth=1, img_size=32, steps=2,
        batch_size=16, num_workers=1, loader="ray_data", augment="device", warmup_steps=1,
        run_name="ray-data-device-test",
    )
    summary = run_pretrain(cfg)
    assert summary["steps"] == 2 and np.isfinite(summary["metrics"]["train_loss"])


def test_ray_data_loader_refuses_a_layout_that_would_stall(small_demo, tmp_path):
    shards = small_demo["work"] / "shards" / "corpus"
    cfg = PretrainConfig(data=str(shards), output=str(tmp_path / "stall"), num_workers=4, loader="ray_data",
                         batch_size=16)  # rows enough for a step, so the layout is what gets refused
    with pytest.raises(ConfigError, match="loader: ray_data needs CPUs for its data tasks"):
        run_pretrain(cfg)


def test_holdout_split_is_pinned_nested_and_near_its_fraction():
    from training.data import holdout_mask

    keys = [f"{i:020x}" for i in range(5000)]
    m10, m20 = holdout_mask(keys, 0.1), holdout_mask(keys, 0.2)
    assert 400 < m10.sum() < 600 and 900 < m20.sum() < 1100
    assert not (m10 & ~m20).any()  # a larger hold-out only adds rows to it
    # Pinned: a resumed run and both loaders must hold out these rows, whatever the order or layout.
    assert np.flatnonzero(m10[:100]).tolist() == [1, 7, 9, 22, 25, 31, 53, 63, 66, 79, 84, 87, 90, 99]


def test_resuming_under_a_different_recipe_is_refused():
    from common.config import free_on_resume
    from training.checkpointer import check_resumable

    free = free_on_resume(PretrainConfig)
    saved = {"lr": 0.001, "epochs": 1, "holdout": 0.02, "run_name": "r"}
    check_resumable(saved, {**saved, "epochs": 5}, free)  # more epochs: fine
    with pytest.raises(ConfigError, match="holdout: checkpoint 0.02, now 0.1"):
        check_resumable(saved, {**saved, "holdout": 0.1}, free)
