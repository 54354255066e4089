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
import json
import os
import socket
import time
import uuid
from typing import Any

from common.config import InputError
from common.fs import is_local, read_json_object, url_to_fs


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
        if is_local(self.fs):
            self._flock()
        else:
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

    def _flock(self) -> None:
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._busy(read_json_object(self.fs, self.path),
                                 "wait for it to finish, or choose another --output") from None
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

    def _create_once(self) -> bool:
        data = json.dumps(self.info).encode()
        try:
            with self.fs.open(self.path, "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError, TypeError):  # no exclusive mode here: write, then read back
            if self.fs.exists(self.path):
                return False
            with self.fs.open(self.path, "wb") as f:
                f.write(data)
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
