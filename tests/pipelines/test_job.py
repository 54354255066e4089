"""jobs/prepare.py as users run it: exit codes, messages, and a SIGKILL in the middle of writing."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.ipc as ipc
import pytest

from pipelines.schema import ShardSet, ShardSetError

REPO = Path(__file__).resolve().parents[2]
JOB = str(REPO / "jobs" / "prepare.py")


def _job(*args, env=None, **kw):
    return subprocess.run([sys.executable, JOB, *args], capture_output=True, text=True, cwd=REPO,
                          env=env or os.environ.copy(), timeout=300, **kw)


def test_missing_output_flag_is_a_usage_error(tmp_path):
    r = _job("--input", str(tmp_path))
    assert r.returncode == 2 and "output" in r.stderr


def test_missing_input_path_exits_nonzero_naming_it(tmp_path):
    r = _job("--input", str(tmp_path / "nope"), "--output", str(tmp_path / "out"))
    assert r.returncode == 2 and "nope" in r.stderr and "input not found" in r.stderr
    assert not (tmp_path / "out").exists()


def test_bad_config_value_names_the_field(tmp_path):
    r = _job("--input", str(tmp_path), "--output", str(tmp_path / "o"), "--quality", "101")
    assert r.returncode == 2 and "quality" in r.stderr and "1..100" in r.stderr
    r = _job("--input", str(tmp_path), "--output", str(tmp_path / "o"), "--test-set", "cifar10")
    assert r.returncode == 2 and "NAME=SRC" in r.stderr


def test_output_inside_the_input_is_refused(tmp_path):
    r = _job("--input", str(tmp_path), "--output", str(tmp_path / "shards"))
    assert r.returncode == 2 and "inside input" in r.stderr


def test_an_input_with_nothing_in_it_exits_nonzero_naming_it(tmp_path):
    (tmp_path / "empty" / ".hidden").mkdir(parents=True)
    r = _job("--input", str(tmp_path / "empty"), "--output", str(tmp_path / "out"))
    assert r.returncode == 2 and "empty" in r.stderr and "nothing to ingest" in r.stderr
    assert not (tmp_path / "out").exists()


def test_names_that_are_not_utf8_are_ingested_not_fatal(tmp_path, photos, enc):
    # One Latin-1 file name used to kill the whole job, dead-letter path included.
    src = os.fsencode(tmp_path / "src")
    os.makedirs(os.path.join(src, b"d\xf6gs"))
    with open(os.path.join(src, b"d\xf6gs", b"caf\xe9.jpg"), "wb") as f:
        f.write(enc(photos["chelsea"], "JPEG"))
    with open(os.path.join(src, b"d\xf6gs", b"vide\xe9.jpg"), "wb") as f:
        pass
    out = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"sh\xe4rds"))  # the output folder too: MLflow, Arrow
    r = _job("--input", os.fsdecode(src), "--output", out, "--size", "32", "--workers", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "/sh\\xe4rds/manifest.json" in r.stdout  # the summary is valid text too
    shards = ShardSet(out)
    shards.verify()
    assert shards.manifest["label_map"] == {"d\\xf6gs": 0}
    assert shards[0]["source"].endswith("/d\\xf6gs/caf\\xe9.jpg")
    with open(os.path.join(os.fsencode(out), b"quarantine.jsonl"), encoding="utf-8") as f:
        (row,) = [json.loads(line) for line in f]
    assert row["reason"] == "empty_file" and row["uri"].endswith("/vide\\xe9.jpg")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, photos, noisy_copies):
    return noisy_copies(tmp_path_factory.mktemp("killsrc"), photos, 48, classes=3, class_prefix="c", spread=30, seed=1,
                        size=(96, 96))


def test_exits_zero_with_quarantined_items_and_prints_a_summary(tmp_path, corpus):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(corpus / "c0", src / "c0")
    (src / "c0" / "bad.jpg").write_bytes(b"")
    r = _job("--input", str(src), "--output", str(tmp_path / "out"), "--size", "32", "--workers", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "quarantined {'empty_file': 1}" in r.stdout
    assert ShardSet(tmp_path / "out").manifest["counts"]["rejected"] == {"empty_file": 1}


def test_killed_run_leaves_no_partial_shard_and_a_rerun_recovers(tmp_path, corpus, prepare):
    args = dict(size=96, store="raw", shard_mb=0.05)
    reference = prepare(input=[str(corpus)], output=str(tmp_path / "ref"), **args)
    assert len(reference["shards"]) > 5

    out = tmp_path / "out"
    prepare(input=[str(corpus)], output=str(out), **args)  # a complete earlier run in the same place
    proc = subprocess.Popen(
        [sys.executable, JOB, "--input", str(corpus), "--output", str(out), "--size", "96", "--store", "raw",
         "--shard-mb", "0.05", "--workers", "1"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    # Kill as soon as this run starts writing a shard (its first temporary file appears).
    seen_tmp = False
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if any(".tmp-" in name for name in os.listdir(out)):
            seen_tmp = True
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.001)
    proc.wait()
    assert seen_tmp, "the run ended before it wrote a shard; the kill did not happen mid-write"

    # The manifest was withdrawn at start and never rewritten: readers refuse the directory...
    assert not (out / "manifest.json").exists()
    with pytest.raises(ShardSetError, match="did not"):
        ShardSet(out)
    # ...and every file under a shard name is a complete Arrow file (partial ones only have .tmp- names).
    for path in out.glob("shard-*.arrow"):
        with open(path, "rb") as f:
            assert ipc.open_file(f).read_all().num_rows > 0

    again = prepare(input=[str(corpus)], output=str(out), **args)
    assert again["shards"] == reference["shards"]
    assert not [p for p in os.listdir(out) if ".tmp-" in p or p.startswith(".staging-")]
    ShardSet(out).verify()
