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


def test_a_reader_in_another_process_keeps_a_writer_out_naming_it_and_other_readers_in(tmp_path, reader_process,
                                                                                      monkeypatch):
    import socket

    from common.locks import READERS_LOCK, DataBusy, DataLock

    monkeypatch.setattr(locks, "READERS_WAIT_S", 0.1)
    with reader_process(tmp_path, "pretrain") as reader:
        with pytest.raises(DataBusy) as busy:
            DataLock(tmp_path, "prepare", exclusive=True, field_name="output").acquire()
        assert "\n" not in str(busy.value)
        assert str(busy.value).startswith(f"output {tmp_path}: this shard set is being read (pretrain run, pid "
                                          f"{reader.pid} on {socket.gethostname()} since ")
        assert str(busy.value).endswith("prepare would change the data under it: wait for that run to finish, or "
                                        "stop it, then run again")
        with DataLock(tmp_path, "finetune") as second:  # readers share it
            assert second._fd is not None
        assert (tmp_path / READERS_LOCK).exists()  # the reader in the other process still holds it
    with DataLock(tmp_path, "prepare", exclusive=True):
        pass
    assert os.listdir(tmp_path) == []  # the last holder tidies the folder


def test_a_reader_killed_with_sigkill_frees_the_set(tmp_path, reader_process):
    from common.locks import READERS_DIR, DataLock

    with reader_process(tmp_path, "finetune") as reader:
        reader.kill()
        reader.wait(timeout=30)
        assert os.listdir(tmp_path / READERS_DIR)  # its note stays, but the kernel dropped its lock
        with DataLock(tmp_path, "dedup", exclusive=True):
            assert not (tmp_path / READERS_DIR).exists()


def test_a_reader_is_refused_while_prepare_or_dedup_rewrites_the_set_naming_it(tmp_path, monkeypatch):
    from common.locks import DataBusy, DataLock

    monkeypatch.setattr(locks, "READERS_WAIT_S", 0.1)
    with FolderLock(str(tmp_path), "prepare", writer="dedup"), DataLock(tmp_path, "dedup", exclusive=True):
        with pytest.raises(DataBusy, match=rf"^data {tmp_path}: a dedup run is rewriting this shard set \(pid "
                                           rf"{os.getpid()} on .*\); wait for it to finish, then run pretrain again$"):
            DataLock(tmp_path, "pretrain").acquire()


def test_where_no_file_lock_can_be_had_a_reader_goes_on_unlocked(tmp_path, monkeypatch, caplog):
    from common.locks import DataLock

    def no_lockd(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    assert DataLock("memory://bucket/set", "pretrain").acquire() is False  # an object store
    monkeypatch.setattr(fcntl, "flock", no_lockd)
    opened_before = len(os.listdir("/proc/self/fd"))
    assert DataLock(tmp_path, "pretrain").acquire() is False
    assert "refuses file locks" in caplog.text and "a resume checks it" in caplog.text
    assert len(os.listdir("/proc/self/fd")) == opened_before  # no descriptor leaked


def test_a_reader_of_a_set_on_a_read_only_mount_reads_it_unlocked(read_only_folder):
    from common.locks import DataLock

    assert DataLock(read_only_folder, "pretrain").acquire() is False


def test_a_resume_on_a_replaced_set_is_refused_in_one_line_unless_data_changed_ok(capsys):
    from common.config import ConfigError
    from common.locks import check_same_data

    then = {"data": {"url": "/sets/a", "manifest_sha256": "a" * 64}}
    now = {"data": {"url": "/sets/a", "manifest_sha256": "b" * 64}}
    args = dict(stage="pretrain", what="run", fix="pass --overwrite to start run 'r' again on it")
    check_same_data(then, then, changed_ok=False, **args)
    check_same_data(None, now, changed_ok=False, **args)  # a record written before sets were recorded
    with pytest.raises(ConfigError) as refused:
        check_same_data(then, now, changed_ok=False, **args)
    assert str(refused.value) == (
        f"data /sets/a: its manifest.json is not the one this run started on (sha256 {'a' * 16}… then, {'b' * 16}… "
        "now: the set was replaced); pass --overwrite to start run 'r' again on it, or pass --data-changed-ok to "
        "resume on the new data")
    check_same_data(then, now, changed_ok=True, **args)
    assert capsys.readouterr().err == (
        f"pretrain: warning: data /sets/a: its manifest.json is not the one this run started on (sha256 {'a' * 16}… "
        f"then, {'b' * 16}… now: the set was replaced); resuming on the new data (--data-changed-ok)\n")
