"""prepare's progress while it runs: true counts from the workers (pipelines.worker_counts), plain lines off a
terminal, a quiet console."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DONE = re.compile(r"^prepare: done in \S+: (\d+) inputs, (\d+) written, (\d+) quarantined, (\d+) duplicates; ")
LIVE = re.compile(r"^prepare: (\d+)/(\d+) inputs seen, (\d+) processed, (\d+) written, (\d+) quarantined, "
                  r"(\d+) duplicates; [\d.]+ img/s")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, photos, noisy_copies):
    """40 distinct images in 4 classes, one exact copy, a truncated PNG, a text file, and a test set of one copy."""
    root = tmp_path_factory.mktemp("progress")
    src = noisy_copies(root / "corpus", photos, 40, classes=4, class_prefix="c", spread=12, seed=3, size=(64, 48))
    first = src / "c0" / "000.png"
    shutil.copy(first, src / "c1" / "copy.png")
    (src / "c2" / "cut.png").write_bytes(first.read_bytes()[:300])
    (src / "c3" / "notes.txt").write_text("not an image")
    test = root / "test" / "t"
    test.mkdir(parents=True)
    shutil.copy(src / "c1" / "001.png", test / "x.png")
    return {"input": src, "test": test.parent, "inputs": 43}


def _summary(manifest: dict) -> tuple[int, int, int, int]:
    c = manifest["counts"]
    return c["inputs"], c["written"], c["rejected_total"], c["duplicates_total"]


def test_worker_processes_report_progress_as_plain_lines_that_end_on_the_final_counts(corpus, tmp_path, mlflow_store):
    """The DirectRunner with two worker processes, stderr a pipe, a 0.2 s interval: a run several intervals long."""
    import json

    out = tmp_path / "shards"
    r = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "prepare.py"), "--input", str(corpus["input"]), "--output", str(out),
         "--size", "32", "--workers", "2", "--test-set", f"t={corpus['test']}", "--progress-every", "0.2"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "VITSCALE_HOME": str(mlflow_store)},
    )
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert "\r" not in r.stderr  # not a terminal: plain lines
    ours = [line for line in lines if line.startswith("prepare: ")]
    assert len(ours) >= 3, r.stderr
    live = [LIVE.match(line) for line in ours if LIVE.match(line)]
    assert live, r.stderr
    assert all(int(m.group(2)) == corpus["inputs"] for m in live)  # the total is known from the plan
    seen = [int(m.group(1)) for m in live]
    assert seen == sorted(seen)  # counts only grow
    manifest = json.loads((out / "manifest.json").read_text())
    done = DONE.match(ours[-1])
    assert done, ours[-1]
    assert tuple(int(g) for g in done.groups()) == _summary(manifest)
    assert _summary(manifest)[0] == 43 and min(_summary(manifest)) > 0  # every kind of count took part
    # The start-up warnings of Beam's optional cloud clients, once per process, are gone.
    assert not [line for line in lines if "GCSFileSystem" in line or "apitools" in line or "Logging handler" in line]


def test_in_process_runs_report_the_same_counts(corpus, tmp_path, prepare, capsys, monkeypatch):
    monkeypatch.setenv("VITSCALE_PROGRESS_EVERY", "0.01")
    manifest = prepare(input=[str(corpus["input"])], output=str(tmp_path / "o"), size=32, workers=1,
                       test_set=[f"t={corpus['test']}"])
    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prepare: ")]
    done = DONE.match(ours[-1])
    assert done, ours
    assert tuple(int(g) for g in done.groups()) == _summary(manifest)


def test_a_tar_source_counts_units_until_its_items_are_known(tmp_path, corpus):
    """Items inside archives are counted as they are read: the line says how many of the units are done."""
    import tarfile

    from common.progress import IngestProgress, ProgressLine
    from pipelines import worker_counts
    from pipelines.sources import plan

    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        tar.add(corpus["input"] / "c0", arcname="c0")
    units = plan(str(tmp_path / "a.tar"))
    channel = tmp_path / "channel"
    channel.mkdir()
    line = ProgressLine("prepare", stream=open(os.devnull, "w"), every=1e-9)
    watch = IngestProgress(line, worker_counts.Totals(str(channel)).poll, len(units), worker_counts.known_inputs(units))
    assert watch.text().startswith("starting")
    worker_counts.count(str(channel), units=1, inputs=11)
    worker_counts.count(str(channel), processed=4, rejected=1)
    assert watch.text().startswith("11 inputs seen (1/1 units), 4 processed, 0 written, 1 quarantined, 0 duplicates;")
    worker_counts.close(str(channel))
