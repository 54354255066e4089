"""Inputs that must not hang, leak or balloon the ingest: special files, secrets, big units.

Everything runs the real prepare on the DirectRunner against real files: a FIFO, a socket,
symlinks to /dev/zero and /proc, sparse files and a GNU sparse tar.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from pipelines.sources import iter_items
from pipelines.testsets import iter_images

REPO = Path(__file__).resolve().parents[2]
SECRET = "VITSCALE_TEST_SECRET=hunter2-do-not-leak"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class _Deadline:
    """Fails the test instead of hanging it: a blocked open() is interrupted by SIGALRM."""

    def __init__(self, seconds: int):
        self.seconds = seconds

    def __enter__(self):
        def fire(*_):
            raise TimeoutError(f"still running after {self.seconds} s")

        self.old = signal.signal(signal.SIGALRM, fire)
        signal.alarm(self.seconds)

    def __exit__(self, *exc):
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.old)


@pytest.fixture
def special_folder(tmp_path, photos, enc, wr):
    root = tmp_path / "in"
    wr(root / "a" / "good.jpg", enc(photos["chelsea"], "JPEG"))
    os.mkfifo(root / "a" / "pipe.jpg")
    (root / "a" / "zero.jpg").symlink_to("/dev/zero")
    (root / "a" / "environ.jpg").symlink_to("/proc/self/environ")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "a" / "sock.jpg"))
    yield root
    sock.close()


def test_special_files_are_refused_from_their_stat_and_nothing_hangs(special_folder, tmp_path, prepare):
    out = tmp_path / "out"
    with _Deadline(90):
        manifest = prepare(input=[str(special_folder)], output=str(out), size=32, max_file_mb=2)
    rows = {Path(r["uri"]).name: r for r in _jsonl(out / "quarantine.jsonl")}
    assert set(rows) == {"pipe.jpg", "zero.jpg", "environ.jpg", "sock.jpg"}
    assert {r["reason"] for r in rows.values()} == {"not_a_regular_file"}
    assert "FIFO" in rows["pipe.jpg"]["detail"] and "device" in rows["zero.jpg"]["detail"]
    assert "/proc" in rows["environ.jpg"]["detail"] and "socket" in rows["sock.jpg"]["detail"]
    counts = manifest["counts"]
    assert counts["inputs"] == 5 and counts["written"] == 1 and counts["rejected"] == {"not_a_regular_file": 4}


def test_a_manifest_naming_a_fifo_and_a_device_is_refused_per_row(tmp_path, photos, enc, wr, prepare):
    good = wr(tmp_path / "good.png", enc(photos["coffee"], "PNG"))
    os.mkfifo(tmp_path / "pipe")
    rows = [{"uri": str(good), "label": "x"}, {"uri": str(tmp_path / "pipe"), "label": "x"},
            {"uri": "file:///dev/zero", "label": "x"}, {"uri": "simplecache::file:///dev/zero", "label": "x"}]
    manifest_path = tmp_path / "m.jsonl"
    manifest_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with _Deadline(90):
        manifest = prepare(input=[str(manifest_path)], output=str(tmp_path / "out"), size=32)
    assert manifest["counts"]["rejected"] == {"not_a_regular_file": 3} and manifest["counts"]["written"] == 1


def test_quarantine_records_say_what_a_file_is_never_its_bytes(tmp_path, photos, enc, wr, prepare):
    from common import tracking

    secret = wr(tmp_path / "src" / "passwd", f"root:x:0:0:root:/root:/bin/bash\n{SECRET}\n".encode())
    page = wr(tmp_path / "src" / "error.jpg", f"<!DOCTYPE html><html><body>{SECRET}</body></html>".encode())
    blob = wr(tmp_path / "src" / "blob.png", b"\x01\x02" + SECRET.encode() + b"\x00\xff")
    good = wr(tmp_path / "src" / "ok.png", enc(photos["coffee"], "PNG"))
    manifest_path = tmp_path / "m.csv"
    manifest_path.write_text("uri,label\n" + "".join(f"{p},x\n" for p in (secret, page, blob, good)))
    out = tmp_path / "out"
    manifest = prepare(input=[str(manifest_path)], output=str(out), size=32)
    text = (out / "quarantine.jsonl").read_text()
    assert "root:x" not in text and "hunter2" not in text and "\\u0001" not in text
    details = {Path(r["uri"]).name: r["detail"] for r in _jsonl(out / "quarantine.jsonl")}
    assert "(text," in details["passwd"] and "(HTML document," in details["error.jpg"]
    assert "(binary data," in details["blob.png"]
    import mlflow

    client = mlflow.MlflowClient(tracking.tracking_uri())
    logged = Path(client.download_artifacts(manifest["mlflow_run_id"], "quarantine.jsonl", str(tmp_path / "dl")))
    assert "hunter2" not in logged.read_text() and "root:x" not in logged.read_text()


def _sparse(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


# Each prepare runs in its own process so that its peak memory is its own (ru_maxrss).
_PEAK = textwrap.dedent("""
    import json, resource, sys
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare
    m = run_prepare(PrepareConfig(input=[sys.argv[1]], output=sys.argv[2], size=32, workers=1, max_file_mb=450))
    print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "counts": m["counts"]}))
""")


def _peak_prepare(source: Path, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _PEAK, str(source), str(out)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


MEMBER = 400_000_000


def _baseline_mb(tmp_path: Path, photos, enc, wr) -> float:
    small = wr(tmp_path / "small" / "a" / "x.jpg", enc(photos["chelsea"], "JPEG"))
    return _peak_prepare(small.parent.parent, tmp_path / "small_out")["peak_mb"]


def test_memory_follows_one_member_of_a_sparse_tar_not_the_whole_tar(tmp_path, photos, enc, wr):
    members = [_sparse(tmp_path / "sparse" / f"m{i}.bin", MEMBER) for i in range(4)]
    archive = tmp_path / "in" / "big.tar"
    archive.parent.mkdir()
    subprocess.run(["tar", "-S", "-cf", str(archive), "-C", str(members[0].parent), *[m.name for m in members]],
                   check=True)
    assert archive.stat().st_size < 100_000
    with tarfile.open(archive) as tf:
        assert [m.size for m in tf.getmembers()] == [MEMBER] * 4
    wr(archive.parent / "ok.jpg", enc(photos["coffee"], "JPEG"))  # a run that writes nothing is refused
    base = _baseline_mb(tmp_path, photos, enc, wr)
    result = _peak_prepare(archive.parent, tmp_path / "out")
    assert result["counts"]["rejected"] == {"not_an_image": 4} and result["counts"]["written"] == 1
    # One 400 MB member at a time, never the four at once.
    assert result["peak_mb"] - base < 1.6 * MEMBER / 1e6, (base, result)


def test_memory_follows_one_file_of_a_folder_not_the_whole_batch(tmp_path, photos, enc, wr):
    for i in range(3):
        _sparse(tmp_path / "in" / "a" / f"big{i}.bin", MEMBER)
    wr(tmp_path / "in" / "a" / "ok.jpg", enc(photos["coffee"], "JPEG"))  # a run that writes nothing is refused
    base = _baseline_mb(tmp_path, photos, enc, wr)
    result = _peak_prepare(tmp_path / "in", tmp_path / "out")
    assert result["counts"]["rejected"] == {"not_an_image": 3} and result["counts"]["written"] == 1
    assert result["peak_mb"] - base < 1.6 * MEMBER / 1e6, (base, result)


def test_test_sets_get_the_corpus_size_cap_and_are_not_read_past_it(tmp_path, photos, enc, wr):
    wr(tmp_path / "t" / "ok.png", enc(photos["coffee"], "PNG"))
    _sparse(tmp_path / "t" / "huge.png", 1_100_000_000)  # above the default 1024 MB
    reasons = {Path(it.uri).name: it.error and it.error[0] for it in iter_images(str(tmp_path / "t"))}
    assert reasons == {"ok.png": None, "huge.png": "too_large"}
    capped = {Path(it.uri).name: it.error for it in iter_items(str(tmp_path / "t"), max_bytes=1000)}
    assert capped["ok.png"][0] == "too_large" and "1100.0 MB" in capped["huge.png"][1]


# -- where inputs may come from -----------------------------------------------------------------

@pytest.fixture
def reaching_manifest(tmp_path, photos, enc, wr):
    """A manifest under data/ whose rows reach outside it in every way a row can."""
    data = tmp_path / "data"
    inside = wr(data / "a" / "in.png", enc(photos["coffee"], "PNG"))
    outside = wr(tmp_path / "private" / "secret.png", enc(photos["chelsea"], "PNG"))
    (data / "a" / "link.png").symlink_to(outside)
    rows = [str(inside), "a/in.png", str(outside), "../private/secret.png", f"file://{outside}",
            f"simplecache::file://{outside}", str(data / "a" / "link.png")]
    manifest = data / "m.jsonl"
    manifest.write_text("".join(json.dumps({"uri": u, "label": "x"}) + "\n" for u in rows))
    return data, manifest


def test_without_allowed_roots_a_manifest_reads_whatever_it_names(reaching_manifest, tmp_path, prepare):
    _, manifest = reaching_manifest
    m = prepare(input=[str(manifest)], output=str(tmp_path / "out"), size=32)
    assert m["counts"]["inputs"] == 7 and m["counts"]["rejected_total"] == 0  # read, then de-duplicated


def test_allowed_roots_quarantine_every_row_that_reaches_outside(reaching_manifest, tmp_path, prepare):
    data, manifest = reaching_manifest
    out = tmp_path / "out"
    m = prepare(input=[str(manifest)], output=str(out), size=32, allowed_roots=[str(data)])
    counts = m["counts"]
    assert counts["rejected"] == {"outside_allowed_roots": 5}
    assert counts["written"] == 1 and counts["duplicates"]["corpus"] == 1  # in.png, named twice
    assert counts["inputs"] == counts["written"] + counts["rejected_total"] + counts["duplicates_total"]
    details = [r["detail"] for r in _jsonl(out / "quarantine.jsonl")]
    assert all("--allowed-roots" in d and "not read" in d for d in details)


def test_allowed_roots_also_hold_for_folder_symlinks_and_archives(tmp_path, photos, enc, wr, prepare):
    data = tmp_path / "data"
    wr(data / "a" / "in.png", enc(photos["coffee"], "PNG"))
    wr(tmp_path / "elsewhere" / "x.png", enc(photos["chelsea"], "PNG"))
    with tarfile.open(tmp_path / "elsewhere" / "t.tar", "w") as tf:
        tf.add(tmp_path / "elsewhere" / "x.png", "x.png")
    (data / "a" / "out.png").symlink_to(tmp_path / "elsewhere" / "x.png")
    (data / "b.tar").symlink_to(tmp_path / "elsewhere" / "t.tar")
    m = prepare(input=[str(data)], output=str(tmp_path / "out"), size=32, allowed_roots=[str(data)])
    assert m["counts"]["rejected"] == {"outside_allowed_roots": 2} and m["counts"]["written"] == 1


def test_allowed_roots_hold_for_test_sets_too(reaching_manifest):
    from common.fs import normalize_root
    from pipelines.testsets import build_test_set_index

    data, manifest = reaching_manifest
    index = build_test_set_index({"t": str(manifest)}, allowed_roots=(normalize_root(str(data)),))
    reasons = sorted(q.reason for q in index.quarantine)
    assert reasons == ["outside_allowed_roots"] * 5 and len(index) >= 1
