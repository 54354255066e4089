"""jobs/pretrain.py refuses to resume from a Ray Train snapshot that reaches outside its run's folder."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ray

from tests.conftest import new_home

REPO = Path(__file__).resolve().parents[2]


def test_pretrain_refuses_a_crafted_snapshot_before_ray_starts(tiny_shards, tmp_path, mlflow_store):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    run_dir = tmp_path / "storage" / "run1"
    run_dir.mkdir(parents=True)
    result = {"version": 0, "checkpoint_dir_name": str(victim), "metrics": {"step": 1}}
    (run_dir / "checkpoint_manager_snapshot.json").write_text(json.dumps({
        "ray_version": ray.__version__, "checkpoint_results": [result], "checkpoint_report_indices": [0],
        "latest_checkpoint_result": result, "pending_training_results": [], "pending_validation_specs": [],
        "current_report_index": 1, "validated_checkpoint_dir_names": [],
        "timed_out_validation_checkpoint_dir_names": [], "failed_validation_checkpoint_dir_names": []}))
    out = subprocess.run([sys.executable, str(REPO / "jobs" / "pretrain.py"), "--data", str(tiny_shards),
                          "--output", str(tmp_path / "out"), "--storage-path", str(tmp_path / "storage"),
                          "--run-name", "run1", "--batch-size", "4", "--num-workers", "1", "--steps", "2",
                          "--keep-checkpoints", "1"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("pretrain: ")]
    assert len(lines) == 1 and f"names checkpoint folder '{victim}'" in lines[0], out.stderr
    assert (victim / "keep.txt").read_text() == "precious"


def test_pretrain_resumes_from_the_checkpoint_before_one_whose_bytes_changed(tiny_shards, tmp_path, job_main,
                                                                             ray_session, monkeypatch):
    from training.checkpointer import TRAIN_STATE, read_record

    out = tmp_path / "out"
    job = ["--data", str(tiny_shards), "--output", str(out), "--variant", "Ti/8", "--depth", "1", "--img-size", "32",
           "--batch-size", "4", "--num-workers", "1", "--checkpoint-every", "2", "--warmup-steps", "1", "--holdout", "0"]
    monkeypatch.setenv("VITSCALE_HOME", str(new_home(tmp_path / "home")))  # both runs are main(argv) on the session's Ray
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = job_main("pretrain", *job, "--steps", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = out / "ray" / json.loads(first.stdout)["checkpoint"].split("/")[-2]
    by_step = {rec["step"]: p for p in run_dir.glob("checkpoint_*") if (rec := read_record(p))}
    assert sorted(by_step) == [2, 4] and all(read_record(p).get("sha256") for p in by_step.values())
    state = by_step[4] / TRAIN_STATE
    with open(state, "r+b") as f:  # a disk error inside the file: its size stays
        f.seek(state.stat().st_size // 2)
        f.write(b"\0" * 4096)

    rerun = job_main("pretrain", *job, "--steps", "6")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert json.loads(rerun.stdout)["resumed_from_step"] == 2
    warned = [line for line in rerun.stderr.splitlines() if "sha256" in line]
    assert warned == [f"pretrain: warning: checkpoint: {by_step[4]} does not match the sha256 its checkpoint.json "
                      f"records; resuming from {by_step[2]} at step 2 instead (remove the bad folder once you have "
                      "looked at it)"], rerun.stderr[-3000:]
