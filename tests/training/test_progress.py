"""What pretrain and few-shot show on the console: step lines from rank 0, task lines, no Ray chatter."""
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
    assert [int(m.group(1)) for m in epochs] == [0, 1], r.stderr  # one line per report, not one per rank
    assert int(epochs[-1].group(2)) == summary["steps"]
    assert not [line for line in lines if any(n in line for n in NOISE)], r.stderr


def test_fewshot_prints_a_line_per_task_with_its_accuracies(tmp_path_factory, build_task_dirs, build_pretrained,
                                                           tmp_path, mlflow_store, capsys):
    from training.fewshot import FewshotConfig, run_fewshot

    tasks = build_task_dirs(tmp_path_factory.mktemp("fewshot"), ["count"], train=40, test=10, train_size=24,
                            val_size=8)
    pretrained = build_pretrained(tmp_path / "model.safetensors", img_size=32, representation_size=16)
    capsys.readouterr()
    summary = run_fewshot(FewshotConfig(pretrained=str(pretrained), task=[f"structured/count={tasks['count']}"],
                                        output=str(tmp_path / "o"), shots=[1, 2], draws=1))
    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fewshot: ")]
    assert ours[0] == "fewshot: task count (1/1): RUNNING, extracting features"
    shots = summary["tasks"]["count"]["shots"]
    assert re.fullmatch(rf"fewshot: task count \(1/1\): done in \S+, 1-shot accuracy {shots['1']['mean']:.3f}, "
                        rf"2-shot accuracy {shots['2']['mean']:.3f}", ours[-1]), ours
