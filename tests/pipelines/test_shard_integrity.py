"""Shards are checked against their manifest's sha256 before anything reads them, once per process.

A shard rewritten after ``prepare`` (every label set to 0, the manifest untouched) is refused
by default, by the library and by a stage's job; a copy handed to another process carries
what was checked, and a file changed since is checked again.
"""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from common import tracking
from pipelines import schema
from pipelines.schema import ShardSet, ShardSetError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def clean_set(tmp_path_factory, photos):
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    root = tmp_path_factory.mktemp("integrity")
    for cls, name in (("cat", "chelsea"), ("coffee", "coffee")):
        (root / "src" / cls).mkdir(parents=True)
        for i in range(8):
            photos[name].rotate(i * 7).save(root / "src" / cls / f"{i}.png")
    run_prepare(PrepareConfig(input=[str(root / "src")], output=str(root / "shards"), size=32, workers=1,
                              shard_mb=0.004))
    return root / "shards"


def _poison(shard_dir: Path, index: int = 0) -> str:
    """Every label of one shard set to 0, written as a valid Arrow file; the manifest stays as it was."""
    name = ShardSet(shard_dir, verify=False).shards[index]["path"]
    path = shard_dir / name
    table = ipc.open_file(pa.memory_map(str(path))).read_all()
    labels = pa.array([[0]] * table.num_rows, type=table.schema.field("labels").type)
    table = table.set_column(table.schema.get_field_index("labels"), "labels", labels)
    with ipc.new_file(str(path) + ".new", table.schema) as w:
        w.write_table(table)
    os.replace(str(path) + ".new", path)
    return name


@pytest.fixture
def poisoned(clean_set, tmp_path):
    copy = tmp_path / "poisoned"
    shutil.copytree(clean_set, copy)
    assert len(ShardSet(copy).shards) >= 2
    return copy, _poison(copy)


def test_a_rewritten_shard_is_refused_by_default(poisoned, monkeypatch):
    monkeypatch.delenv("VITSCALE_SKIP_SHARD_VERIFY", raising=False)
    copy, name = poisoned
    with pytest.raises(ShardSetError, match=rf"^{name}: sha256 mismatch \(manifest says .*\); re-run prepare$"):
        list(ShardSet(copy).iter_batches())
    # Skipping is asked for, not the default; then the file reads as it is.
    monkeypatch.setenv("VITSCALE_SKIP_SHARD_VERIFY", "1")
    assert sum(b.num_rows for b in ShardSet(copy).iter_batches()) > 0


def test_a_training_stage_refuses_a_rewritten_shard_in_one_line(poisoned, tmp_path):
    copy, name = poisoned
    env = {k: v for k, v in os.environ.items() if k != "VITSCALE_SKIP_SHARD_VERIFY"}
    out = subprocess.run([sys.executable, str(REPO / "jobs" / "pretrain.py"), "--data", str(copy), "--output",
                          str(tmp_path / "out"), "--batch-size", "4", "--num-workers", "1", "--steps", "1"],
                         capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("pretrain: ")]
    assert len(lines) == 1 and f"{name}: sha256 mismatch" in lines[0] and "re-run prepare" in lines[0], out.stderr


def test_each_shard_is_hashed_once_and_copies_carry_it(clean_set, tmp_path, monkeypatch):
    monkeypatch.delenv("VITSCALE_SKIP_SHARD_VERIFY", raising=False)
    copy = tmp_path / "s"
    shutil.copytree(clean_set, copy)
    hashed = []
    real = schema.file_sha256
    monkeypatch.setattr(schema, "file_sha256", lambda path, fs=None: hashed.append(path) or real(path, fs))
    driver = ShardSet(copy)
    driver.verify_shards()
    n = len(driver.shards)
    assert len(hashed) == n
    list(driver.iter_batches())
    worker = pickle.loads(pickle.dumps(driver))  # a DataLoader worker's copy
    list(worker.iter_batches())
    list(ShardSet(copy, verified=driver.verified_shards()).iter_batches())  # a Ray read task's
    assert len(hashed) == n
    # A file changed after the check is checked again, and refused.
    _poison(copy, 1)
    with pytest.raises(ShardSetError, match="sha256 mismatch"):
        pickle.loads(pickle.dumps(driver)).open_shard(1)


def test_runs_that_read_shards_say_whether_they_were_checked(monkeypatch):
    record = {"manifest_sha256": "ab" * 32, "dedup_state": "none"}
    monkeypatch.delenv("VITSCALE_SKIP_SHARD_VERIFY", raising=False)
    assert tracking.run_tags({}, data=[record])["vitscale.shard_verify"] == "sha256"
    monkeypatch.setenv("VITSCALE_SKIP_SHARD_VERIFY", "1")
    assert tracking.run_tags({}, data=[record])["vitscale.shard_verify"].startswith("skipped")
    assert "vitscale.shard_verify" not in tracking.run_tags({})
