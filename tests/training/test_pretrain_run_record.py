"""training.pretrain's run record: a resumed pre-training reopens the MLflow run it was killed in,
and a run replaced with --overwrite does not stay RUNNING."""
from __future__ import annotations

import dataclasses
import json

from tests.conftest import mlflow_client
from training.pretrain import RUN_RECORD, PretrainConfig, _claim


def test_a_sigkilled_run_is_reopened_on_resume_and_marked_killed_when_replaced(tmp_path, mlflow_store):
    client = mlflow_client()
    # What a SIGKILLed driver leaves: its run RUNNING, its id in the output's run record.
    dead = client.create_run(client.create_experiment("vitscale-pretrain")).info.run_id
    out = tmp_path / "out"
    out.mkdir()
    cfg = PretrainConfig(data=str(tmp_path / "shards"), output=str(out), run_name="r1")
    (out / RUN_RECORD).write_text(json.dumps({"run_name": "r1", "config": dataclasses.asdict(cfg),
                                              "mlflow_run_id": dead}))
    storage = (str(out / "ray"), None)

    *_, reopen = _claim(dataclasses.replace(cfg, run_name=None), storage)
    assert reopen == dead
    assert json.loads((out / RUN_RECORD).read_text())["mlflow_run_id"] == dead

    replaced, *_, reopen = _claim(dataclasses.replace(cfg, run_name=None, overwrite=True), storage)
    assert reopen is None and replaced.run_name != "r1"
    assert client.get_run(dead).info.status == "KILLED"


def test_a_resume_on_a_replaced_shard_set_is_refused_in_one_line_unless_data_changed_ok(tiny_shards, tmp_path, job_main,
                                                                                         mlflow_store, capfd):
    # A prepare --overwrite while the run was stopped: its resume trained on other data, silently.
    import hashlib
    import shutil

    shards = tmp_path / "shards"
    shutil.copytree(tiny_shards, shards, ignore=shutil.ignore_patterns(".readers*"))  # not the notes of runs reading it now
    out = tmp_path / "out"
    cfg = PretrainConfig(data=str(shards), output=str(out), batch_size=4, num_workers=1)
    started, *_ = _claim(cfg, (str(out / "ray"), None))  # what a run records before Ray starts
    manifest = shards / "manifest.json"
    then = hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert json.loads((out / RUN_RECORD).read_text())["data"] == {
        "data": {"url": str(shards), "manifest_sha256": then}}
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "mlflow_run_id": "another-prepare"}))
    now = hashlib.sha256(manifest.read_bytes()).hexdigest()

    refused = job_main("pretrain", "--data", str(shards), "--output", str(out), "--batch-size", "4",
                       "--num-workers", "1")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert [line for line in refused.stderr.splitlines() if line.startswith("pretrain: ")] == [
        f"pretrain: error: data {shards}: its manifest.json is not the one this run started on (sha256 {then[:16]}… "
        f"then, {now[:16]}… now: the set was replaced); pass --overwrite to start run {started.run_name!r} again on "
        "it, or pass --data-changed-ok to resume on the new data"], refused.stderr[-3000:]
    assert "Ray" not in refused.stderr

    resumed, *_ = _claim(dataclasses.replace(cfg, data_changed_ok=True), (str(out / "ray"), None))
    assert resumed.run_name == started.run_name
    assert "resuming on the new data (--data-changed-ok)" in capfd.readouterr().err
    assert json.loads((out / RUN_RECORD).read_text())["data"]["data"]["manifest_sha256"] == now  # what it runs on now


def test_a_finished_run_submitted_again_keeps_the_figures_of_its_end(tmp_path):
    from training.pretrain import carried_over

    earlier = tmp_path / "pretrain_summary.json"
    earlier.write_text(json.dumps({"steps": 132, "metrics": {"step": 132, "holdout_accuracy": 0.397,
                                                             "train_loss": 1.64}}))
    # What the rerun's checkpoint reports: where it stands, no figure of a step it did not train.
    rerun = {"steps": 132, "resumed_from_step": 132, "metrics": {"step": 132, "start_step": 132}}
    assert carried_over(rerun, earlier)["metrics"] == {"step": 132, "holdout_accuracy": 0.397, "train_loss": 1.64,
                                                       "start_step": 132}
    trained = {"steps": 140, "resumed_from_step": 132, "metrics": {"step": 140, "holdout_accuracy": 0.41}}
    assert carried_over(trained, earlier) == trained  # it trained: its own figures only
    assert carried_over(rerun, tmp_path / "none.json") == rerun


def test_a_storage_path_outside_the_output_has_its_run_folder_locked_too(tmp_path):
    import contextlib

    import pytest

    from common.locks import FolderBusy
    from training.pretrain import _storage, lock_run_folder

    cfg = PretrainConfig(data=str(tmp_path / "shards"), output=str(tmp_path / "a"), storage_path=str(tmp_path / "shared"),
                         run_name="r1")
    storage = _storage(cfg, tmp_path / "a")
    with contextlib.ExitStack() as held:
        lock_run_folder(cfg, storage, held)
        with pytest.raises(FolderBusy, match="another pretrain run is writing there"), contextlib.ExitStack() as other:
            lock_run_folder(dataclasses.replace(cfg, output=str(tmp_path / "b")), storage, other)
    with contextlib.ExitStack() as again:  # released with its run
        lock_run_folder(cfg, storage, again)
