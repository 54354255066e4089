"""What pretrain shows on the console: step lines from rank 0, no Ray chatter."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEP = re.compile(r"^pretrain: step (\d+)/(\d+) \(\d+%\), loss [\d.]+, [\d.]+ img/s")
EPOCH = re.compile(r"^pretrain: epoch (\d+) to step (\d+)/(\d+): train loss [\d.]+ accuracy [\d.]+[;,] ")
NOISE = ("PlacementGroupCleaner", "PreemptionWatcher", "TrainingReport", "Token authentication",
         "Checkpoint successfully created", "Failed to import GCSFileSystem", "apitools")


@pytest.fixture(scope="module")
def shards(tmp_path_factory, mlflow_store):
    from demo.data import build
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    root = tmp_path_factory.mktemp("console")
    data = build(root / "data", per_shape=6, per_photo=3, train_images=10, test_images=10, planted=0)
    run_prepare(PrepareConfig(input=[str(data.corpus)], output=str(root / "shards"), size=32, workers=1))
    return root / "shards"


def test_pretrain_prints_step_lines_on_the_driver_and_none_of_rays_chatter(shards, tmp_path, mlflow_store):
    r = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "pretrain.py"), "--data", str(shards), "--output", str(tmp_path / "o"),
         "--variant", "Ti/8", "--depth", "1", "--img-size", "32", "--epochs", "2", "--batch-size", "16",
         "--warmup-steps", "2", "--num-workers", "2", "--log-every", "1", "--progress-every", "0.01"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO), "VITSCALE_HOME": str(mlflow_store)},
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    lines = r.stderr.splitlines()
    steps = [STEP.match(line) for line in lines if STEP.match(line)]
    epochs = [EPOCH.match(line) for line in lines if EPOCH.match(line)]
    assert len(steps) >= 2, r.stderr
    assert all(int(m.group(2)) == summary["planned_steps"] for m in steps)  # "out of total"
    assert any("ETA" in line for line in lines if STEP.match(line))
    # One line per report, not one per rank, and the last one says --epochs, not one less.
    assert [int(m.group(1)) for m in epochs] == [1, 2], r.stderr
    assert int(epochs[-1].group(2)) == summary["steps"]
    assert not [line for line in lines if any(n in line for n in NOISE)], r.stderr
