"""jobs/pretrain.py refuses to resume from a Ray Train snapshot that reaches outside its run's folder."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parents[2]


def test_pretrain_refuses_a_crafted_snapshot_before_ray_starts(tmp_path, mlflow_store):
    from common.photos import photo
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    for cls, name in (("cat", "chelsea.png"), ("coffee", "coffee.png")):
        (tmp_path / "src" / cls).mkdir(parents=True)
        img = photo(name)
        for i in range(8):
            img.crop((i * 20, i * 10, i * 20 + 200, i * 10 + 200)).save(tmp_path / "src" / cls / f"{i}.png")
    run_prepare(PrepareConfig(input=[str(tmp_path / "src")], output=str(tmp_path / "shards"), size=32, workers=1))
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
    out = subprocess.run([sys.executable, str(REPO / "jobs" / "pretrain.py"), "--data", str(tmp_path / "shards"),
                          "--output", str(tmp_path / "out"), "--storage-path", str(tmp_path / "storage"),
                          "--run-name", "run1", "--batch-size", "4", "--num-workers", "1", "--steps", "2",
                          "--keep-checkpoints", "1"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("pretrain: ")]
    assert len(lines) == 1 and f"names checkpoint folder '{victim}'" in lines[0], out.stderr
    assert (victim / "keep.txt").read_text() == "precious"
