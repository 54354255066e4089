"""One writer per output folder: a lock file that names its holder, on a local disk or over fsspec.

Two runs of a stage into one folder would overwrite each other's files (shards mixed under one
manifest, one checkpoint folder written twice), so a run holds ``FOLDER/.<stage>.lock`` (its
host, pid and start time) from start to end, and a second run is refused in one line that
names the holder.

- On a local disk the lock is an ``flock``, which the kernel drops with its process, however the
  process ends.
- On other filesystems (object stores, fsspec) it is the file alone, created only if absent. A file
  left by a process of this host that is gone is stale and taken over; one from another host is
  named with the fix (delete it if that process is gone).

A shard set's readers share another lock (:class:`DataLock`), which a ``prepare`` replacing the
set or a ``dedup`` rewriting it must hold alone; where no lock can be had, a resume compares the
manifest's sha256 with the one its run recorded (:func:`check_same_data`).
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import sys
import time
import uuid
from typing import Any, Iterator

from common.config import ConfigError, InputError
from common.fs import is_local, read_json_object, url_to_fs

log = logging.getLogger(__name__)

# Backends whose "xb" fails atomically when the file exists. fsspec leaves exclusive mode to each
# backend, and its generic path checks, then writes: two runs can both pass the check.
EXCLUSIVE_CREATE = frozenset({"file", "local", "memory"})
# Seconds between writing a lock file where "xb" is not atomic and reading it back: a run that
# checked before another wrote is then the one that reads the other's token.
SETTLE_S = 1.0


class FolderBusy(InputError):
    """Another run of a stage holds the folder."""


def lock_name(stage: str) -> str:
    return f".{stage}.lock"


def _holder_text(info: dict) -> str:
    started = info.get("started")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else ""
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')}{when}"


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FolderLock:
    """The lock of ``stage`` on the output folder ``url`` (which exists), held from ``acquire`` (or
    ``__enter__``) to ``release``.

    ``writer`` names the stage that holds it when another stage writes into that stage's folder:
    ``dedup`` writes ``removed.jsonl`` into a shard set, so it takes the folder's ``prepare`` lock as
    ``writer="dedup"``, and a refused run is told which of the two is writing there.
    """

    def __init__(self, url: str, stage: str, writer: str | None = None):
        self.fs, root = url_to_fs(str(url))
        self.path = f"{root}/{lock_name(stage)}"
        self.stage, self.label = stage, f"output {url}"
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "token": uuid.uuid4().hex,
                     "stage": writer or stage}
        self._fd: int | None = None
        self._held = False

    def __enter__(self) -> "FolderLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _busy(self, holder: dict, fix: str) -> FolderBusy:
        stage = holder.get("stage") if isinstance(holder.get("stage"), str) else self.stage
        return FolderBusy(f"{self.label}: another {stage} run is writing there ({_holder_text(holder)}); {fix}")

    def acquire(self) -> None:
        if is_local(self.fs) and self._flock():
            return
        self._create_file()

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)  # before the unlock, so a waiting run never locks a removed file
            os.close(self._fd)
            self._fd = None
        if self._held and read_json_object(self.fs, self.path).get("token") == self.info["token"]:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path)
        self._held = False

    def _open_lock_file(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise InputError(f"{self.label}: cannot write there ({os.strerror(exc.errno)}: {self.path}); "
                                 "give a writable folder") from None
            raise

    def _flock(self) -> bool:
        """Hold the kernel's lock on the file; False where the filesystem has none (NFS without lockd)."""
        import fcntl

        while True:
            fd = self._open_lock_file()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._busy(read_json_object(self.fs, self.path),
                                 "wait for it to finish, or choose another --output") from None
            except OSError as exc:
                os.close(fd)
                log.warning("%s: this filesystem refuses file locks (%s); using the lock file alone, as on an "
                            "object store", self.path, os.strerror(exc.errno or 0))
                with contextlib.suppress(OSError):
                    if os.path.getsize(self.path) == 0:
                        os.remove(self.path)  # the empty file just created, not a holder's
                return False
            # The holder before us may have removed the file after we opened it: lock the file at the path.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(self.info).encode())
        return True

    def _exclusive(self) -> bool:
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        return bool(EXCLUSIVE_CREATE.intersection(protocols))

    def _create_once(self) -> bool:
        data = json.dumps(self.info).encode()
        if self._exclusive():
            try:
                with self.fs.open(self.path, "xb") as f:
                    f.write(data)
            except FileExistsError:
                return False
            return read_json_object(self.fs, self.path).get("token") == self.info["token"]
        # Elsewhere: check, write, and read back after the settle time; of two runs that both passed
        # the check, the first to write reads the second's token and stands down.
        if self.fs.exists(self.path):
            return False
        with self.fs.open(self.path, "wb") as f:
            f.write(data)
        time.sleep(SETTLE_S)
        return read_json_object(self.fs, self.path).get("token") == self.info["token"]

    def _create_file(self) -> None:
        for _ in range(2):
            if self._create_once():
                self._held = True
                return
            holder = read_json_object(self.fs, self.path)
            if holder.get("host") == self.info["host"] and not _pid_alive(holder.get("pid")):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(self.path)  # stale: its process on this host is gone
                continue
            break
        raise self._busy(holder, f"wait for it to finish, or, if that process is gone, delete {self.path} and run again")


#: Names, in a folder, the stage that owns it: two stages in one folder overwrite each other's state.
OWNER_FILE = ".vitscale-stage.json"
# What folders written before they named their owner hold, by the stage that wrote them.
_OWNER_SIGNS = {"manifest.json": "prepare", "pretrain_run.json": "pretrain", "finetune_sweep_state.json": "finetune",
                "vtab_sweep_state.json": "vtab"}


def folder_owner(folder: os.PathLike) -> str | None:
    """The stage that owns the local ``folder``: the one it records, else the one whose files it
    holds (a folder written before owners were recorded); None for a folder no stage wrote."""
    owner = read_json_object(url_to_fs(str(folder))[0], os.path.join(folder, OWNER_FILE)).get("stage")
    if isinstance(owner, str):
        return owner
    for name, stage in _OWNER_SIGNS.items():
        if os.path.exists(os.path.join(folder, name)):
            return stage
    legacy = read_json_object(url_to_fs(str(folder))[0], os.path.join(folder, "sweep_state.json")).get("config")
    if isinstance(legacy, dict):
        return "finetune" if "train" in legacy else "vtab"
    return None


def check_owner(folder: os.PathLike, stage: str, field_name: str = "output") -> None:
    """Refuse, in one line, a ``stage`` run into a folder another stage owns (read-only: call it
    before writing anything there)."""
    owner = folder_owner(folder) if os.path.isdir(folder) else None
    if owner not in (None, stage):
        raise InputError(f"{field_name} {folder}: belongs to a {owner} run (its state is there, which this {stage} "
                         f"run would overwrite); give this {stage} run another --{field_name}")


def claim_folder(folder: os.PathLike, stage: str, field_name: str = "output") -> None:
    """Record ``stage`` as the owner of the local ``folder``, or refuse as :func:`check_owner` does
    when another stage claimed it first (two runs that both passed the check)."""
    check_owner(folder, stage, field_name)
    path = os.path.join(folder, OWNER_FILE)
    tmp = f"{path}.{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        f.write(json.dumps({"stage": stage}))
    try:
        os.link(tmp, path)  # whole, and only if no other run's record is there
    except FileExistsError:
        check_owner(folder, stage, field_name)
    finally:
        os.remove(tmp)


#: In a shard set's folder: the lock every run that reads the set shares, and that a run which
#: replaces or rewrites the set (prepare, dedup) holds alone; beside it, one file per reader naming it.
READERS_LOCK = ".readers.lock"
READERS_DIR = ".readers"
# Seconds a lock is tried before it is refused: a reader that ends takes the lock alone for an
# instant, to remove the lock file if it was the last.
READERS_WAIT_S = 1.0


class DataBusy(InputError):
    """A shard set that one run reads and another would replace or rewrite."""


class DataLock:
    """The readers' lock of the local shard set ``folder``, held from :meth:`acquire` to :meth:`release`.

    Shared (``exclusive=False``) by each run that reads the set: a prepare that would replace it, or
    a dedup that would rewrite it, takes it ``exclusive`` and is refused in one line naming the
    readers. A reader is refused, likewise, while a prepare or dedup holds it. Where no lock can be
    had (an object store, NFS without lockd, a read-only mount for a reader) :meth:`acquire` returns
    False: the reader's record of the manifest's sha256 (:func:`check_same_data`) guards its resume.

    ``field_name`` names the set in messages (the flag it came from); ``stage`` is the run's stage.
    """

    def __init__(self, folder: os.PathLike | str, stage: str, *, exclusive: bool = False, field_name: str = "data"):
        self.folder, self.stage, self.exclusive, self.field_name = str(folder), stage, exclusive, field_name
        self.path = os.path.join(self.folder, READERS_LOCK)
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "stage": stage}
        self._fd: int | None = None
        self._note: str | None = None

    def __enter__(self) -> "DataLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> bool:
        """Take the lock; False where none can be had, :class:`DataBusy` while the other kind holds it."""
        import fcntl

        if not is_local(url_to_fs(self.folder)[0]) or not os.path.isdir(self.folder):
            return False
        op = (fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + READERS_WAIT_S
        while True:
            fd = self._open()
            if fd is None:
                return False
            try:
                fcntl.flock(fd, op)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise self._busy() from None
            except OSError as exc:
                os.close(fd)
                log.warning("%s: this filesystem refuses file locks (%s); the run records the manifest's sha256 "
                            "instead, and a resume checks it", self.path, os.strerror(exc.errno or 0))
                return False
            if self._same_file(fd):
                break
            os.close(fd)  # the last holder removed the file after we opened it: lock the file at the path
        self._fd = fd
        if self.exclusive:  # notes left now are of readers whose processes are gone: the kernel dropped their locks
            shutil.rmtree(os.path.join(self.folder, READERS_DIR), ignore_errors=True)
        else:
            self._write_note()
        return True

    def release(self) -> None:
        import fcntl

        if self._fd is None:
            return
        if self._note:
            with contextlib.suppress(OSError):
                os.remove(self._note)
            self._note = None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # alone now: the last holder tidies the folder
        except OSError:
            pass
        else:
            shutil.rmtree(os.path.join(self.folder, READERS_DIR), ignore_errors=True)  # the notes left are stale
            with contextlib.suppress(OSError):
                os.remove(self.path)
        os.close(self._fd)
        self._fd = None

    def _open(self) -> int | None:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if self.exclusive or exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
        # A reader of a set it cannot write: locked where the file is there, else no run here can replace the set.
        try:
            return os.open(self.path, os.O_RDONLY)
        except OSError:
            return None

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _write_note(self) -> None:
        notes = os.path.join(self.folder, READERS_DIR)
        path = os.path.join(notes, f"{self.info['host']}.{self.info['pid']}.{uuid.uuid4().hex[:8]}.json")
        try:
            os.makedirs(notes, exist_ok=True)
            with open(path, "w") as f:
                f.write(json.dumps(self.info))
        except OSError:  # a read-only set: its readers go unnamed
            return
        self._note = path

    def readers(self) -> list[dict]:
        """The runs that hold the lock shared, from their notes (those of gone processes on this host left out)."""
        notes = os.path.join(self.folder, READERS_DIR)
        try:
            names = sorted(os.listdir(notes))
        except OSError:
            return []
        found = [read_json_object(url_to_fs(notes)[0], os.path.join(notes, n)) for n in names if n.endswith(".json")]
        return [r for r in found if r and (r.get("host") != self.info["host"] or _pid_alive(r.get("pid")))]

    def _busy(self) -> DataBusy:
        where = f"{self.field_name} {self.folder}"
        if self.exclusive:
            runs = self.readers()
            who = "; ".join(f"{r.get('stage', '?')} run, {_holder_text(r)}" for r in runs) or "by a run that left no note"
            return DataBusy(f"{where}: this shard set is being read ({who}); {self.stage} would change the data "
                            "under it: wait for that run to finish, or stop it, then run again")
        holder = read_json_object(url_to_fs(self.folder)[0], os.path.join(self.folder, lock_name("prepare")))
        stage = holder.get("stage") if isinstance(holder.get("stage"), str) else "prepare or dedup"
        return DataBusy(f"{where}: a {stage} run is rewriting this shard set ({_holder_text(holder)}); wait for it "
                        f"to finish, then run {self.stage} again")


@contextlib.contextmanager
def reading(stage: str, sets: dict[str, Any]) -> Iterator[None]:
    """Hold the readers' lock of each local shard set in ``sets`` (field name -> folder) for the block.
    A folder that is None or missing is left to the stage's own checks, which name it."""
    with contextlib.ExitStack() as stack:
        for field_name, folder in sets.items():
            path = os.path.expanduser(str(folder)) if folder else None
            if path and os.path.isdir(path):
                lock = DataLock(path, stage, field_name=field_name)
                if lock.acquire():
                    stack.callback(lock.release)
        yield


def check_same_data(recorded: Any, now: dict[str, dict], *, stage: str, what: str, fix: str,
                    changed_ok: bool) -> None:
    """Refuse, in one line, a resume whose shard sets' manifests are not those its run started on.

    ``recorded`` and ``now`` map a set's name (its flag, or ``task/split``) to ``{"url",
    "manifest_sha256"}``; a set one of them lacks (a record written before sets were recorded) is
    not compared. ``changed_ok`` (``--data-changed-ok``) resumes anyway, with one warning line.
    """
    if not isinstance(recorded, dict):
        return
    for name, rec in now.items():
        old = (recorded.get(name) or {}).get("manifest_sha256") if isinstance(recorded.get(name), dict) else None
        new = rec.get("manifest_sha256")
        if not old or old == new:
            continue
        change = (f"{name} {rec.get('url')}: its manifest.json is not the one this {what} started on (sha256 "
                  f"{old[:16]}… then, {str(new)[:16]}… now: the set was replaced)")
        if not changed_ok:
            raise ConfigError(f"{change}; {fix}, or pass --data-changed-ok to resume on the new data")
        print(f"{stage}: warning: {change}; resuming on the new data (--data-changed-ok)", file=sys.stderr)
