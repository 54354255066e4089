"""Ray Tune fine-tuning: input checks, the select-then-retrain protocol, resuming a killed sweep."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vitcore
from common.config import ConfigError
from tests.conftest import new_home
from transfer.finetune import FinetuneConfig, run_finetune

REPO = Path(__file__).resolve().parents[2]


def test_missing_pretrained_model_is_named(small_demo, tmp_path):
    shards = small_demo["work"] / "shards"
    cfg = FinetuneConfig(train=str(shards / "digits-train"), test=str(shards / "digits-test"),
                         pretrained=str(tmp_path / "missing.safetensors"), output=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="pretrained: .*missing.safetensors does not exist"):
        run_finetune(cfg)


def test_mismatched_label_maps_are_refused(small_demo, tmp_path):
    shards = small_demo["work"] / "shards"
    cfg = FinetuneConfig(train=str(shards / "digits-train"), test=str(shards / "corpus"), output=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="test: label map of .* differs from train's"):
        run_finetune(cfg)


def test_missing_train_shards_are_named(tmp_path):
    cfg = FinetuneConfig(train=str(tmp_path / "t"), test=str(tmp_path / "u"), output=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="train: .* has no manifest.json"):
        run_finetune(cfg)


def test_a_split_whose_every_row_was_removed_is_refused_before_ray(tmp_path, tiny_shards):
    import shutil

    from pipelines.schema import ShardSet, append_removed

    empty = tmp_path / "empty"
    shutil.copytree(tiny_shards, empty)
    append_removed(empty, [{"key": row["key"]} for row in ShardSet(empty)])  # dedup removed every row
    cfg = FinetuneConfig(train=str(empty), test=str(empty), output=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="train: .*empty has 0 rows, too few to hold out"):
        run_finetune(cfg)
    assert not (tmp_path / "o").exists()


def test_an_unlabelled_split_is_refused_before_ray(tmp_path, unlabelled_shards, tiny_shards):
    import ray

    ray_was_up = ray.is_initialized()
    cfg = FinetuneConfig(train=str(tiny_shards), test=str(unlabelled_shards), output=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match=r"test: .* is unlabelled \(none of its 16 rows has a label\); "
                                          "fine-tuning needs labelled splits"):
        run_finetune(cfg)
    assert ray.is_initialized() == ray_was_up and not (tmp_path / "o").exists()


def test_the_run_is_named_after_the_dataset_when_one_is_given():
    from transfer.finetune import run_name

    cfg = FinetuneConfig(train="/d/rot4/train800", test="/t", dataset="rot4", pretrained="/m/pre/model.safetensors")
    assert run_name(cfg, "rot4/train800") == "finetune rot4 from pre"
    assert run_name(FinetuneConfig(train="/d/x/train800", test="/t"), "x/train800") == "finetune x/train800"


def test_dev_fractions_follow_the_paper_and_are_configurable():
    def frac(**kw):
        return FinetuneConfig(train=kw.pop("train", "/d/task-train"), test="/t", **kw).dev_fraction()

    assert frac(train="/d/oxford_pets/train") == 0.1
    assert frac(train="/d/flowers102-train") == 0.1
    assert frac(train="/d/cifar100_train") == 0.02
    assert frac(dataset="imagenet") == 0.01
    assert frac() == 0.1  # the default for other datasets
    assert frac(dataset="imagenet", dev_fractions={"imagenet": 0.05}) == 0.05
    assert frac(dataset="imagenet", val_fraction=0.2) == 0.2
    with pytest.raises(ConfigError, match="microbatch: --batch-size 512 must be a multiple of --microbatch 100"):
        FinetuneConfig(train="/a", test="/b", microbatch=100)


def test_selected_model_is_the_best_on_val_and_retrained_on_all_of_train(small_demo):
    from pipelines.schema import ShardSet

    fine = small_demo["summary"]["finetune"]
    best = max(fine["trials"], key=lambda r: r["val_accuracy"])
    assert fine["selected_val_accuracy"] == best["val_accuracy"]
    assert fine["selected_lr"] == best["lr"]
    train = ShardSet(small_demo["work"] / "shards" / "digits-train")
    assert fine["final_train_rows"] == len(train)  # the final model saw the entire train split
    assert 0.0 <= fine["test_accuracy"] <= 1.0
    model = vitcore.load_checkpoint(fine["model"])
    assert model.config.num_classes == 10 and model.config.representation_size is None


def _runs(home: Path):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps) if exps else []


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the driver's whole session: the driver and the Ray processes it started."""
    victims = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == proc.pid:
                    victims.append(int(entry))
            except OSError:
                pass
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.wait(timeout=60)


def test_killed_sweep_resumes_without_rerunning_finished_trials(small_demo, tmp_path):
    shards = small_demo["work"] / "shards"
    home = tmp_path / "mlruns"
    env = dict(os.environ, VITSCALE_HOME=str(new_home(home)), PYTHONPATH=str(REPO))
    for k in ("MLFLOW_TRACKING_URI", "VITSCALE_PARENT_RUN_ID", "RAY_ADDRESS"):
        env.pop(k, None)
    out = tmp_path / "out"
    lrs = [0.01, 0.03, 0.1]
    cmd = [sys.executable, str(REPO / "jobs" / "finetune.py"), "--train", str(shards / "digits-train"),
           "--test", str(shards / "digits-test"), "--pretrained", small_demo["summary"]["pretrain"]["model"],
           "--output", str(out), "--lrs", ",".join(map(str, lrs)), "--steps", "40", "--batch-size", "16",
           "--microbatch", "8", "--warmup-steps", "2", "--max-concurrent", "1", "--flip", "false"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 240
        done = []
        while time.time() < deadline and proc.poll() is None:
            # A trial's final report carries its model as a checkpoint (MLflow's store is left
            # alone meanwhile: a second client could race the driver creating its tables).
            done = list((out / "ray" / "select").glob("*/checkpoint_*"))
            if done:
                break
            time.sleep(0.5)
        assert done, "no selection trial finished before the deadline"
        time.sleep(3)  # let Tune record the trial as terminated
    finally:
        _kill_session(proc)
    finished_before = {float(r.data.params["lr"]) for r in _runs(home)
                       if r.data.tags.get("vitscale.stage") == "finetune-select" and r.info.status == "FINISHED"}
    assert len(finished_before) < len(lrs), "the sweep ended before it could be interrupted"

    rerun = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads((out / "finetune_summary.json").read_text())
    runs = _runs(home)
    select = [r for r in runs if r.data.tags.get("vitscale.stage") == "finetune-select"]
    for lr in finished_before:  # finished trials were kept, not trained again
        assert sum(float(r.data.params["lr"]) == lr for r in select) == 1
    assert {float(r.data.params["lr"]) for r in select if r.info.status == "FINISHED"} == set(lrs)
    parents = {r.data.tags["mlflow.parentRunId"] for r in select}
    assert parents == {summary["mlflow_run_id"]}  # the resumed sweep kept its MLflow run
    assert not [r for r in runs if r.info.status == "RUNNING"]
    assert [t["lr"] for t in summary["trials"]] == lrs
    assert summary["selected_val_accuracy"] == max(t["val_accuracy"] for t in summary["trials"])


def test_a_final_model_that_fails_its_sha256_is_refused_in_one_line_naming_the_fix(
        tiny_shards, tmp_path, build_pretrained, job_main, ray_session, mlflow_store):
    from training.checkpointer import sha256_of

    pretrained = build_pretrained(tmp_path / "model.safetensors", img_size=32, representation_size=16)
    out = tmp_path / "out"
    args = ["--train", str(tiny_shards), "--test", str(tiny_shards), "--pretrained", str(pretrained), "--output",
            str(out), "--lrs", "0.1", "--steps", "2", "--batch-size", "4", "--warmup-steps", "1", "--val-fraction", "0.25"]
    assert job_main("finetune", *args).returncode == 0
    [checkpoint] = (out / "ray" / "final").glob("*/checkpoint_*")
    record = json.loads((checkpoint / "checkpoint.json").read_text())
    assert record["sha256"] == {"model.safetensors": sha256_of(out / "model.safetensors")}

    (out / "finetune_summary.json").unlink()  # killed after the final trial, before its summary was written
    data = bytearray((checkpoint / "model.safetensors").read_bytes())
    data[-100] ^= 0xFF  # a tensor's byte: the header still reads, so only the sha256 can tell
    (checkpoint / "model.safetensors").write_bytes(bytes(data))
    refused = job_main("finetune", *args)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert [line for line in refused.stderr.splitlines() if line.startswith("finetune: ")] == [
        f"finetune: error: checkpoint: no checkpoint of finetune trial {checkpoint.parent.name} matches the sizes and sha256 "
        f"its checkpoint.json records ({checkpoint}); remove {out / 'ray' / 'final'} and re-run the same command "
        "to run that sweep's trials again"]
