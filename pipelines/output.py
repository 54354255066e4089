"""A ``prepare`` run's hold on its output folder: one writer at a time, and a swap that keeps a set readable.

- **One writer.** A run holds ``DIR/.prepare.lock`` (its host and pid) from start to end. Two runs into
  one folder deleted each other's staging folders and mixed their shards under one manifest; the
  second one now says who holds the folder and exits 2. On a local disk the lock is an ``flock``,
  which the kernel drops with its process; on other filesystems (fsspec) it is the file alone, and a
  file left by a process of this host that is gone is stale and taken over.
- **The old set stays readable.** The new shards are written under the run's staging folder; the
  old manifest and shards stay until :meth:`OutputFolder.swap` replaces them at the end, with
  SIGINT and SIGTERM held back. A run killed harder during the swap leaves no manifest (a clear
  refusal), never an old manifest over new shards.
- **A set of other inputs is replaced only with ``--overwrite``,** and a replaced set takes its
  dedup files (``removed.jsonl``, ``dedup_state.json``, ``dedup_index/``, ``dedup_report/``) with
  it: they describe shards that are gone.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import uuid
from typing import Any, Iterator, Sequence

from common.config import InputError
from common.fs import atomic_write, is_local
from common.fs import url_to_fs as _fs
from pipelines import schema

LOCK = ".prepare.lock"
#: What a dedup run writes into a shard set; it holds for those shards only.
DEDUP_FILES = (schema.REMOVED, schema.DEDUP_STATE, "dedup_index", "dedup_report")
SET_FILES = (schema.QUARANTINE, schema.DUPLICATES)


class OutputError(InputError):
    """The output folder is held by another run, or holds a shard set this run may not replace."""


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


def _read_info(fs, path: str) -> dict:
    try:
        with fs.open(path, "rt") as f:
            info = json.load(f)
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


class _LocalLock:
    """An ``flock`` on the lock file: held while the process lives, whatever kills it."""

    def __init__(self, path: str, info: dict, output: str):
        self.path, self.info, self.output, self.fd = path, info, output, None

    def acquire(self) -> None:
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = _read_info(_fs(self.path)[0], self.path)
                raise OutputError(
                    f"output {self.output}: another prepare run is writing there ({_holder_text(holder)}); "
                    "wait for it to finish, or choose another --output"
                ) from None
            # The holder before us may have removed the file after we opened it: lock the file at the path.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(self.info).encode())

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)  # before the unlock, so a waiting run never locks a removed file
        os.close(self.fd)
        self.fd = None


class _FileLock:
    """A lock file created only if absent, for filesystems without ``flock`` (object stores, fsspec)."""

    def __init__(self, fs, path: str, info: dict, output: str):
        self.fs, self.path, self.info, self.output, self.held = fs, path, info, output, False

    def _create(self) -> bool:
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
        return _read_info(self.fs, self.path).get("token") == self.info["token"]

    def acquire(self) -> None:
        for _ in range(2):
            if self._create():
                self.held = True
                return
            holder = _read_info(self.fs, self.path)
            if holder.get("host") == self.info["host"] and not _pid_alive(holder.get("pid")):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(self.path)  # stale: its process on this host is gone
                continue
            break
        raise OutputError(
            f"output {self.output}: another prepare run is writing there ({_holder_text(holder)}); wait for it to "
            f"finish, or, if that process is gone, delete {self.path} and run again"
        )

    def release(self) -> None:
        if self.held and _read_info(self.fs, self.path).get("token") == self.info["token"]:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path)
        self.held = False


def _norm_sources(sources: Sequence[str]) -> list[str]:
    out = []
    for src in sources:
        try:
            fs, path = _fs(src)
            out.append(fs.unstrip_protocol(path))
        except Exception:  # noqa: BLE001 - an unresolvable old source compares as written
            out.append(str(src))
    return sorted(out)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends, then act as they would have."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old = {s: signal.signal(s, lambda signum, _frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for s in caught[:1]:
            os.kill(os.getpid(), s)


class OutputFolder:
    """The output folder of one ``prepare`` run, held from ``__enter__`` to ``__exit__``.

    Args:
        url: the folder (local path or fsspec URL); it exists already.
        sources: this run's ``--input``, compared with the sources of a set already there.
        overwrite: replace a set of other inputs (``--overwrite``).
    """

    def __init__(self, url: str, sources: Sequence[str], *, overwrite: bool = False):
        self.output = str(url)
        self.fs, self.root = _fs(url)
        self.sources, self.overwrite = list(sources), overwrite
        info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "token": uuid.uuid4().hex}
        path = f"{self.root}/{LOCK}"
        self._lock = _LocalLock(path, info, self.output) if is_local(self.fs) else _FileLock(self.fs, path, info, self.output)

    def __enter__(self) -> "OutputFolder":
        self._lock.acquire()
        try:
            self._check_replaceable()
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def old_manifest(self) -> dict | None:
        """The manifest of the set in the folder now, ``{}`` if it is unreadable, None if there is none."""
        path = f"{self.root}/{schema.MANIFEST}"
        if not self.fs.exists(path):
            return None
        info = _read_info(self.fs, path)
        return info

    def _check_replaceable(self) -> None:
        old = self.old_manifest()
        if old is None or self.overwrite:
            return
        before = old.get("sources")
        if isinstance(before, list) and _norm_sources(before) == _norm_sources(self.sources):
            return
        what = f"a shard set of other inputs ({', '.join(map(str, before))})" if isinstance(before, list) and before \
            else f"a {schema.MANIFEST} this run cannot read"
        raise OutputError(
            f"output {self.output}: holds {what}; pass --overwrite to replace it (its dedup files go with it), "
            "or choose another --output"
        )

    def swap(self, shards_dir: str, manifest: dict, files: dict[str, bytes]) -> None:
        """Make the new set in ``shards_dir`` (the run's staging) the folder's set, ``manifest`` last.

        ``files`` are the set's other files by name (quarantine, duplicates), written before the
        manifest. A set with exactly the old shards keeps the old dedup files: they checked these bytes.
        """
        fs, root = self.fs, self.root
        old = self.old_manifest()
        same = old is not None and [(s.get("path"), s.get("sha256")) for s in old.get("shards", [])
                                    if isinstance(s, dict)] == [(s["path"], s["sha256"]) for s in manifest["shards"]]
        keep = {s["path"] for s in manifest["shards"]}
        with _signals_held():
            if not same:
                # Withdrawn first: a run killed from here on leaves no manifest, never an old one over new shards.
                if old is not None:
                    fs.rm(f"{root}/{schema.MANIFEST}")
                for name in DEDUP_FILES:
                    if fs.exists(f"{root}/{name}"):
                        fs.rm(f"{root}/{name}", recursive=True)
                for path in fs.glob(f"{root}/shard-*.arrow"):
                    if path.rsplit("/", 1)[-1] not in keep:
                        fs.rm(path)  # a shard of the old set that the new one does not have
                for name in sorted(keep):
                    if is_local(fs):
                        os.replace(f"{shards_dir}/{name}", f"{root}/{name}")  # fs.mv would move it into a folder there
                    else:
                        fs.mv(f"{shards_dir}/{name}", f"{root}/{name}")
            for name, data in files.items():
                atomic_write(f"{root}/{name}", data, fs)
            atomic_write(f"{root}/{schema.MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode(), fs)
