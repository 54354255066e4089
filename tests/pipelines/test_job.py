"""jobs/prepare.py as users run it: exit codes, messages, and a SIGKILL in the middle of writing."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.schema import ShardSet
from tests.conftest import new_home

REPO = Path(__file__).resolve().parents[2]
JOB = str(REPO / "jobs" / "prepare.py")


def _chosen(line: str) -> bool:
    """The line with which ``--format auto`` says which reader an input got."""
    return line.endswith("(auto; name another with --format)")


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


def test_a_run_that_writes_nothing_exits_2_and_keeps_the_old_set(tmp_path, corpus, prepare):
    # It used to exit 0 with an empty set, and pre-training then said "lower batch_size or num_workers".
    bad = tmp_path / "bad"
    for i in range(3):
        (bad / "c0").mkdir(parents=True, exist_ok=True)
        (bad / "c0" / f"{i}.jpg").write_text("not a picture")
    (bad / "c0" / "3.jpg").write_bytes(b"")
    out = tmp_path / "out"
    old = prepare(input=[str(corpus / "c0")], output=str(out), size=32)
    r = _job("--input", str(bad), "--output", str(out), "--size", "32", "--workers", "1", "--overwrite")
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("prepare: error:")]
    assert "4 inputs -> 0 written" in line and "most common reason: not_an_image (3)" in line
    assert "the shard set already there is kept" in line
    assert ShardSet(out).manifest["shards"] == old["shards"] and ShardSet(out).manifest["sources"] == old["sources"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".prepare")) == []

    r = _job("--input", str(bad), "--output", str(tmp_path / "new"), "--size", "32", "--workers", "1")
    assert r.returncode == 2 and "no shard set was written" in r.stderr
    assert not (tmp_path / "new" / "manifest.json").exists()


def test_most_items_rejected_for_one_reason_is_warned_in_one_line(tmp_path, corpus):
    import shutil

    src = tmp_path / "src"
    (src / "c0").mkdir(parents=True)
    shutil.copy(sorted((corpus / "c0").iterdir())[0], src / "c0" / "good.png")
    for i in range(3):
        (src / "c0" / f"{i}.cls").write_text(str(i))
    r = _job("--input", str(src), "--output", str(tmp_path / "out"), "--size", "32", "--workers", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = [x for x in r.stderr.splitlines() if "warning" in x]
    assert "3 of 4 inputs were quarantined as not_an_image" in line and ".cls" in line


def _popen(corpus, out, *extra):
    return subprocess.Popen(
        [sys.executable, JOB, "--input", str(corpus), "--output", str(out), "--store", "raw", "--shard-mb", "0.05",
         "--workers", "1", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _staged_tmp(out: Path) -> bool:
    """A shard of the run is being written: its temporary file is under the staging folder."""
    return any(".tmp-" in p.name for p in out.glob(".staging-*/shards/*"))


def _swapping(out: Path) -> bool:
    """The run is replacing the set: the old manifest is gone, or a set file is being written."""
    return not (out / "manifest.json").exists() or any(".tmp-" in name for name in os.listdir(out))


def _signal_when(proc, out: Path, ready, sig) -> bool:
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            now = ready(out)
        except FileNotFoundError:  # the run removed a folder as the check listed it: not the moment yet
            now = False
        if now:
            proc.send_signal(sig)
            proc.communicate(timeout=120)
            return True
        time.sleep(0.001)
    proc.communicate(timeout=120)
    return False


def test_a_rerun_interrupted_at_any_moment_leaves_a_readable_set(tmp_path, corpus, prepare):
    # A re-run used to delete manifest.json as it started: a SIGINT 2 s in left shards no reader would open.
    old = prepare(input=[str(corpus)], output=str(tmp_path / "old"), size=96, store="raw", shard_mb=0.05)
    new = prepare(input=[str(corpus)], output=str(tmp_path / "new"), size=80, store="raw", shard_mb=0.05)
    assert len(old["shards"]) > 5 and old["shards"] != new["shards"]
    out = tmp_path / "out"
    prepare(input=[str(corpus)], output=str(out), size=96, store="raw", shard_mb=0.05)

    moments = [
        ("as it starts", lambda d: (d / ".prepare.lock").exists() or any(d.glob(".staging-*")), signal.SIGINT),
        ("while writing a shard", _staged_tmp, signal.SIGINT),
        ("killed while writing a shard", _staged_tmp, signal.SIGKILL),
        ("while replacing the set", _swapping, signal.SIGINT),
    ]
    for moment, ready, sig in moments:
        hit = _signal_when(_popen(corpus, out, "--size", "80"), out, ready, sig)
        shards = ShardSet(out)  # never refused: the old set, or the new one whole
        shards.verify()
        assert shards.manifest["shards"] in (old["shards"], new["shards"]), moment
        assert len(shards) == sum(s["rows"] for s in shards.manifest["shards"]), moment
        if shards.manifest["shards"] == new["shards"]:
            assert moment == "while replacing the set" or not hit, moment
            prepare(input=[str(corpus)], output=str(out), size=96, store="raw", shard_mb=0.05)  # back to the old set

    again = prepare(input=[str(corpus)], output=str(out), size=80, store="raw", shard_mb=0.05)
    assert again["shards"] == new["shards"]
    assert not [p for p in os.listdir(out) if ".tmp-" in p or p.startswith((".staging-", ".prepare.lock"))]
    ShardSet(out).verify()


def test_a_second_run_into_a_busy_folder_is_refused_and_the_first_completes(tmp_path, corpus, photos, noisy_copies):
    # Two runs into one folder used to delete each other's staging folders and mix their shards.
    other = noisy_copies(tmp_path / "other", photos, 12, classes=2, class_prefix="o", spread=30, seed=7, size=(96, 96))
    out = tmp_path / "out"
    first = _popen(corpus, out, "--size", "64")
    deadline = time.monotonic() + 240
    while first.poll() is None and time.monotonic() < deadline and not any(out.glob(".staging-*")):
        time.sleep(0.01)
    # Held still while the second runs from start to end: the race is then the same on every machine.
    os.kill(first.pid, signal.SIGSTOP)
    try:
        second = _popen(other, out, "--size", "64")
        _, err2 = second.communicate(timeout=300)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, err1 = first.communicate(timeout=300)
    assert first.returncode == 0, err1[-2000:]
    assert second.returncode == 2, err2[-2000:]
    lines = err2.strip().splitlines()
    assert len(lines) == 1 and "another prepare run is writing there" in lines[0] and f"pid {first.pid} on " in lines[0]
    shards = ShardSet(out)
    shards.verify()
    assert shards.manifest["counts"]["written"] == 48 == len(shards)
    assert {shards[i]["source"].split("/")[-2] for i in range(len(shards))} == {"c0", "c1", "c2"}


def test_a_stale_lock_file_of_a_dead_process_does_not_block(tmp_path, corpus, prepare):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / ".prepare.lock").write_text(json.dumps({"host": os.uname().nodename, "pid": int(dead.stdout)}))
    prepare(input=[str(corpus / "c0")], output=str(out), size=32)
    ShardSet(out).verify()


def test_a_set_of_other_inputs_is_replaced_only_with_overwrite_and_whole(tmp_path, corpus, prepare, photos,
                                                                         noisy_copies):
    # prepare over another set used to overwrite it silently and keep its dedup files, so the next
    # pretrain recorded lineage to dedup runs that had checked other data.
    other = noisy_copies(tmp_path / "other", photos, 12, classes=2, class_prefix="o", spread=30, seed=7, size=(96, 96))
    out = tmp_path / "out"
    first = prepare(input=[str(corpus)], output=str(out), size=32)
    dedup_files = {"removed.jsonl": '{"key": "k"}\n', "dedup_state.json": '{"runs": [{"mlflow_run_id": "r1"}]}',
                   "dedup_index/index.npz": "x", "dedup_report/counts.json": "{}"}

    def leave_dedup_files():
        for name, text in dedup_files.items():
            (out / name).parent.mkdir(exist_ok=True)
            (out / name).write_text(text)

    leave_dedup_files()
    again = prepare(input=[str(corpus)], output=str(out), size=32)  # the same inputs and shards: dedup still holds
    assert again["shards"] == first["shards"] and all((out / name).exists() for name in dedup_files)

    r = _job("--input", str(other), "--output", str(out), "--size", "32", "--workers", "1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert "holds a shard set of other inputs" in r.stderr and "--overwrite" in r.stderr
    assert ShardSet(out).manifest["shards"] == first["shards"] and (out / "removed.jsonl").exists()

    replaced = prepare(input=[str(other)], output=str(out), size=32, overwrite=True)
    shards = ShardSet(out)
    shards.verify()
    assert shards.manifest["shards"] == replaced["shards"] and len(shards) == 12
    assert not any((out / name).exists() for name in ("removed.jsonl", "dedup_state.json", "dedup_index",
                                                      "dedup_report"))
    assert sorted(p.name for p in out.glob("shard-*.arrow")) == [s["path"] for s in replaced["shards"]]


@pytest.mark.parametrize("sig,whole_group,started", [(signal.SIGTERM, False, 2), (signal.SIGINT, True, 2),
                                                     (signal.SIGTERM, False, 1)],
                         ids=["SIGTERM to the driver alone", "Ctrl-C to the process group",
                              "SIGTERM while the second worker starts"])
def test_a_signal_during_a_multi_worker_ingest_ends_it_in_one_line(tmp_path, photos, noisy_copies, sig, whole_group,
                                                                   started):
    # A SIGTERM to the driver alone used to hang it for good (Beam's teardown waited on workers that never
    # heard of it); a Ctrl-C reached every worker, which printed 120-178 lines of gRPC tracebacks. A worker
    # still being started when the signal came was missed by a one-off kill, and waited on for good (CI).
    import psutil

    src = noisy_copies(tmp_path / "src", photos, 300, classes=3, class_prefix="c", spread=30, seed=3, size=(96, 96))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, JOB, "--input", str(src), "--output", str(out), "--size", "64",
                             "--workers", "2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    workers = []
    def sdk_worker(p) -> bool:
        try:
            return p.name().startswith("python") and any("sdk_worker_main" in part for part in p.cmdline())
        except psutil.Error:  # a child that ended between the listing and the look (a flake on CI)
            return False

    while proc.poll() is None and time.monotonic() < deadline and len(workers) < started:
        with contextlib.suppress(psutil.NoSuchProcess):
            workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if sdk_worker(p)]
        time.sleep(0.01)
    assert proc.poll() is None, "the ingest ended before its workers were seen"
    os.killpg(proc.pid, sig) if whole_group else os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-3000:]
    lines = [x for x in err.splitlines() if not x.startswith("prepare: starting") and not _chosen(x)]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"prepare: interrupted by {signal.Signals(sig).name}; no shard set was written to ")
    assert "resume with: python " in lines[0]
    def alive(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    assert not any(alive(p) for p in workers)


@pytest.fixture
def small_disk(tmp_path):
    """A 600 kB tmpfs: a disk that fills during an ingest of a few megabytes."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (mount -t tmpfs); not available here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_is_one_line_naming_the_free_space_and_the_need_and_leaves_no_staging(tmp_path, small_disk):
    # It was exit 1 after 127 lines of Beam traceback, with the staging folders left until the next run.
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (tmp_path / "src" / cls).mkdir(parents=True)
        for i in range(12):  # noise: incompressible, 1.8 MB in all
            Image.fromarray(rng.integers(0, 255, (160, 160, 3), dtype=np.uint8)).save(tmp_path / "src" / cls / f"{i}.png")
    out = small_disk / "out"
    r = _job("--input", str(tmp_path / "src"), "--output", str(out), "--size", "128", "--workers", "1",
             env={**os.environ, "VITSCALE_HOME": str(new_home(tmp_path / "home"))})
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines()
             if line.startswith("prepare: ") and "starting" not in line and not _chosen(line)]
    assert len(lines) == 2, r.stderr
    assert lines[0].startswith(f"prepare: warning: output {out}: 0.6 MB free, and this run may need up to 3.")
    assert lines[1].startswith(f"prepare: error: output {out}: the disk is full (")
    assert "MB free, and this run needs up to 3." in lines[1] and "choose another --output" in lines[1]
    assert os.listdir(out) == []  # no staging, plan or lock left


def test_prepare_overwrite_is_refused_while_another_process_reads_the_set(tmp_path, tiny_shards, reader_process,
                                                                           job_main, monkeypatch):
    # It replaced the set under a running pretrain, both exited 0, and the run's lineage named a manifest gone.
    import shutil

    from common import locks

    monkeypatch.setattr(locks, "READERS_WAIT_S", 0.1)
    monkeypatch.setenv("VITSCALE_HOME", str(new_home(tmp_path / "home")))
    shards = tmp_path / "shards"
    shutil.copytree(tiny_shards, shards, ignore=shutil.ignore_patterns(".readers*"))  # not the notes of runs reading it now
    before = {p.name: p.stat().st_mtime_ns for p in shards.iterdir()}
    with reader_process(shards, "pretrain") as reader:
        out = job_main("prepare", "--input", str(tiny_shards.parent / "src" / "cat"), "--output", str(shards),
                       "--overwrite", "--size", "32", "--workers", "1")
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("prepare: ")]
    assert len(lines) == 1 and lines[0].startswith(f"prepare: error: output {shards}: this shard set is being read "
                                                   f"(pretrain run, pid {reader.pid} on "), out.stderr
    assert lines[0].endswith("prepare would change the data under it: wait for that run to finish, or stop it, then "
                             "run again")
    assert {p.name: p.stat().st_mtime_ns for p in shards.iterdir()} == before  # the set as it was
