"""The output folder's writer lock where the filesystem falls short: no flock, no atomic "xb", no writes."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import threading

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from common import locks
from common.config import InputError
from common.locks import FolderBusy, FolderLock


class CheckThenWriteFS(MemoryFileSystem):
    """An object store whose "xb" is fsspec's generic check-then-write: two writers can both pass."""

    protocol = ("laxstore",)
    root_marker = "/"
    store: dict = {}
    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol("memory://" + path.removeprefix("laxstore://"))

    def _open(self, path, mode="rb", **kwargs):
        return super()._open(path, "wb" if mode == "xb" else mode, **kwargs)


fsspec.register_implementation("laxstore", CheckThenWriteFS, clobber=True)


def test_where_exclusive_create_is_not_atomic_two_racing_runs_never_both_hold(monkeypatch):
    monkeypatch.setattr(locks, "SETTLE_S", 0.3)
    url = "laxstore://bucket/out"
    CheckThenWriteFS().makedirs("/bucket/out", exist_ok=True)
    barrier, held, refused = threading.Barrier(2), [], []
    real_exists = CheckThenWriteFS.exists

    def both_check_first(self, path, **kw):
        found = real_exists(self, path, **kw)
        barrier.wait(timeout=5)  # each run has looked before either writes
        return found

    monkeypatch.setattr(CheckThenWriteFS, "exists", both_check_first)

    def run(lock: FolderLock):
        try:
            lock.acquire()
            held.append(lock)
        except FolderBusy as exc:
            refused.append(str(exc))

    a, b = FolderLock(url, "prepare"), FolderLock(url, "prepare")
    b.info["pid"] = os.getppid()  # another process, alive
    threads = [threading.Thread(target=run, args=(lk,)) for lk in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    monkeypatch.setattr(CheckThenWriteFS, "exists", real_exists)
    assert len(held) == 1 and len(refused) == 1, (held, refused)
    on_disk = json.loads(CheckThenWriteFS().cat_file("/bucket/out/.prepare.lock"))
    assert on_disk["token"] == held[0].info["token"]
    held[0].release()


def test_a_filesystem_without_file_locks_falls_back_to_the_lock_file_and_still_refuses_a_second_run(
        tmp_path, monkeypatch, caplog):
    def no_lockd(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_lockd)
    opened_before = len(os.listdir("/proc/self/fd"))
    with FolderLock(str(tmp_path), "pretrain") as first:
        assert "refuses file locks" in caplog.text and str(tmp_path) in caplog.text
        assert json.loads((tmp_path / ".pretrain.lock").read_text())["token"] == first.info["token"]
        with pytest.raises(FolderBusy, match="another pretrain run is writing there"):
            FolderLock(str(tmp_path), "pretrain").acquire()
    assert not (tmp_path / ".pretrain.lock").exists()
    assert len(os.listdir("/proc/self/fd")) == opened_before  # no descriptor leaked


def test_an_existing_folder_on_a_read_only_mount_is_refused_in_one_line(read_only_folder):
    with pytest.raises(InputError) as info:
        FolderLock(str(read_only_folder), "prepare").acquire()
    message = str(info.value)
    assert "\n" not in message and str(read_only_folder) in message
    assert "Read-only file system" in message and "give a writable folder" in message


def test_a_folder_belongs_to_the_first_stage_that_claims_it(tmp_path):
    import json

    import pytest

    from common.config import InputError
    from common.locks import check_owner, claim_folder, folder_owner

    claim_folder(tmp_path, "finetune")
    claim_folder(tmp_path, "finetune")  # its own re-run
    with pytest.raises(InputError, match=r"belongs to a finetune run .* give this vtab run another --output"):
        claim_folder(tmp_path, "vtab")
    assert folder_owner(tmp_path) == "finetune" and [p.name for p in tmp_path.iterdir()] == [".vitscale-stage.json"]
    old = tmp_path / "old"  # written before folders named their owner: known by what it holds
    old.mkdir()
    (old / "sweep_state.json").write_text(json.dumps({"config": {"data_root": "/v"}, "mlflow_run_id": "r"}))
    with pytest.raises(InputError, match="belongs to a vtab run"):
        check_owner(old, "finetune")
    check_owner(tmp_path / "missing", "prepare")
