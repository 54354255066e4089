"""A disk that fills at a checkpoint ends pre-training in one line: the path, its free space, the
checkpoint kept and the command that resumes; and that command resumes once there is room."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import new_home

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkpoint_disk(tmp_path):
    """A 12 MB tmpfs: room for one checkpoint of a one-block Ti/8 (about 8 MB), not two."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (mount -t tmpfs); not available here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_at_a_checkpoint_names_the_kept_one_and_the_same_command_resumes(tiny_shards, tmp_path,
                                                                                    checkpoint_disk):
    import mlflow

    storage = checkpoint_disk / "ckpt"
    job = [sys.executable, str(REPO / "jobs" / "pretrain.py"), "--data", str(tiny_shards),
           "--output", str(tmp_path / "out"), "--storage-path", str(storage), "--run-name", "full",
           "--variant", "Ti/8", "--depth", "1", "--img-size", "32", "--batch-size", "4", "--num-workers", "1",
           "--steps", "4", "--checkpoint-every", "2", "--warmup-steps", "1", "--holdout", "0"]
    env = {**os.environ, "VITSCALE_HOME": str(new_home(tmp_path / "home")), "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    full = subprocess.run(job, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert full.returncode == 2, full.stderr[-3000:]
    assert "Traceback" not in full.stderr, full.stderr[-3000:]
    ends = [line for line in full.stderr.splitlines() if line.startswith("pretrain: error:")]
    assert len(ends) == 1, full.stderr[-3000:]
    end = ends[0]
    assert "no space left on the disk writing" in end and "MB free there" in end and str(checkpoint_disk) in end, end
    assert "kept its checkpoint at step 2 of 4" in end and "then resume with: python " in end, end
    # The step whose checkpoint did not fit is never reported as saved.
    assert not [line for line in full.stderr.splitlines() if "4/4" in line and "checkpoint saved" in line], full.stderr
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs if r.info.run_name.startswith("pretrain")] == ["FAILED"]

    subprocess.run(["mount", "-o", "remount,size=64m", str(checkpoint_disk)], check=True, capture_output=True)
    resumed = subprocess.run(job, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 4, summary
