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
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

from common.config import InputError
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
