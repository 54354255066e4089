"""Filesystem helpers every layer shares: fsspec URLs and atomic writes.

A file written through :func:`atomic_open` appears under its final name only once it is
complete, so a reader (or a resumed job) never sees half a shard, manifest or state file.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import stat
import uuid
from pathlib import Path
from typing import Any, Iterator

import fsspec

from common.config import ConfigError

# Partial files are written as <final name>.tmp-<uuid>, then renamed.
TMP_MARKER = ".tmp-"

#: Set to 1 to read shards without checking their sha256 against the manifest
#: (pipelines.schema.ShardSet); every run that reads shard sets is then tagged so.
SKIP_SHARD_VERIFY_ENV = "VITSCALE_SKIP_SHARD_VERIFY"


def shard_verify_default() -> bool:
    """Whether shards are checked against their manifest's sha256 unless a caller says otherwise."""
    return os.environ.get(SKIP_SHARD_VERIFY_ENV, "").strip().lower() not in ("1", "true", "yes", "on")


def url_to_fs(url: str | os.PathLike, fs=None):
    """``(filesystem, path)`` for a local path or fsspec URL, without a trailing slash.

    A caller that already holds the filesystem passes it as ``fs`` and gets it back.
    """
    if fs is not None:
        return fs, str(url).rstrip("/")
    fs, path = fsspec.core.url_to_fs(os.fsdecode(url) if isinstance(url, bytes) else str(url))
    return fs, path.rstrip("/")


def make_output_dir(path: str | os.PathLike, field_name: str = "output") -> Path:
    """``path`` (user-expanded, absolute) as a directory, created if missing.

    An existing file there, or a parent that is a file or not writable, is a ``ConfigError``
    naming the field, so an entrypoint ends in one line instead of an ``OSError`` traceback.
    """
    out = Path(path).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{field_name}: {out} is an existing file; give a directory (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"{field_name}: {out} cannot be created, a parent is a file; give another directory") from None
    except PermissionError:
        raise ConfigError(f"{field_name}: {out} cannot be created (permission denied); give a writable directory") from None
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise
        raise ConfigError(f"{field_name}: {out} is on a read-only file system; give a writable directory") from None
    if not os.access(out, os.W_OK):
        why = "on a read-only file system" if _read_only(out) else "not writable by this user"
        raise ConfigError(f"{field_name}: {out} is {why}; give a writable directory")
    return out


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def is_local(fs) -> bool:
    return type(fs).__name__ == "LocalFileSystem"


def read_json_object(fs, path: str) -> dict:
    """The JSON object in ``path``, or ``{}`` when it is missing, unreadable or not an object."""
    try:
        with fs.open(path, "rt") as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _fsync_dir(path: str) -> None:
    # The rename is durable only once the directory entry is on disk.
    try:
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def tmp_name(path: str) -> str:
    """The name a file is written under beside ``path`` before it is renamed to ``path``."""
    return f"{path}{TMP_MARKER}{uuid.uuid4().hex}"


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, fs=None, mode: str = "wb") -> Iterator[Any]:
    """A file that appears at ``path`` only once it is completely written and closed.

    It is written under a temporary name beside ``path`` and renamed; on a local disk the file
    and its directory are fsynced first. If the block raises, the temporary file is removed and
    ``path`` is untouched. ``mode`` is ``"wb"`` or ``"w"`` (UTF-8 text).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open: mode must be 'wb' or 'w', not {mode!r}")
    if fs is None:
        fs, path = url_to_fs(path)
    path = os.fspath(path)
    tmp = tmp_name(path)
    local = is_local(fs)
    text = {"encoding": "utf-8"} if mode == "w" else {}
    try:
        with (open(tmp, mode, **text) if local else fs.open(tmp, mode, **text)) as f:
            yield f
            if local:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp) if local else fs.rm(tmp)
        raise
    if local:
        os.replace(tmp, path)
        _fsync_dir(path)
    else:
        fs.mv(tmp, path)


def atomic_write(path: str | os.PathLike, data: bytes | str, fs=None) -> None:
    """Write ``data`` (bytes, or text as UTF-8) to ``path`` atomically (see :func:`atomic_open`)."""
    with atomic_open(path, fs, "w" if isinstance(data, str) else "wb") as f:
        f.write(data)


# Kernel file systems whose "files" are not data: reading them yields process state
# (/proc/self/environ), never ends, or has side effects.
_PSEUDO_FS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
                        "securityfs", "configfs", "bpf", "pstore", "efivarfs", "fusectl", "mqueue", "binfmt_misc"})


@functools.lru_cache(maxsize=1)
def _pseudo_devices() -> frozenset[int]:
    devices = set()
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                fstype = fields[fields.index("-") + 1]
                if fstype in _PSEUDO_FS:
                    major, minor = fields[2].split(":")
                    devices.add(os.makedev(int(major), int(minor)))
    except (OSError, ValueError, IndexError):
        pass
    return frozenset(devices)


def local_target(url: str) -> str | None:
    """The local path that an fsspec URL finally opens (the last link of a ``a::b`` chain), or None."""
    last = str(url).rsplit("::", 1)[-1]
    if "://" not in last:
        return last
    protocol, _, path = last.partition("://")
    return path if protocol in ("file", "local") else None


def irregular_reason(st: os.stat_result) -> str | None:
    """Why a file with this ``stat`` is not one to read as data, or None for a regular file."""
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        return None  # opening it fails on its own, with its own message
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    if not stat.S_ISREG(mode):
        return "not a regular file"
    if st.st_dev in _pseudo_devices():
        return "a kernel file (/proc, /sys), not data"
    return None


def irregular_file(url: str) -> str | None:
    """Why the local file ``url`` names (symlinks followed) must not be opened, or None.

    FIFOs block an open until a writer comes, devices never end (/dev/zero), and /proc
    entries hold process state; each is refused from its ``stat``, before it is opened.
    Remote URLs and missing files give None: opening them reports their own error.
    """
    path = local_target(url)
    if path is None:
        return None
    try:
        return irregular_reason(os.stat(path))
    except (OSError, ValueError):
        return None


def normalize_root(root: str) -> str:
    """An allowed-roots entry in the form :func:`within_roots` compares: a resolved local path, or the URL."""
    local = local_target(root) if "::" not in str(root) else None
    if local is not None:
        return os.path.realpath(os.path.expanduser(local)).rstrip("/") or "/"
    return str(root).rstrip("/")


def within_roots(url: str, roots) -> bool:
    """Whether ``url`` reads only under one of ``roots`` (normalised by :func:`normalize_root`).

    A local file is judged by its real path, symlinks and ``..`` resolved, so a folder's
    symlink to /etc/passwd is outside a root that holds the link. Of an fsspec chain
    (``simplecache::file:///x``, ``tar://m::/data/a.tar``) the last link is what is read from
    storage, and is judged. A remote URL must start with a URL root and hold no ``..``.
    """
    link = str(url).rsplit("::", 1)[-1]
    local = local_target(link)
    if local is not None:
        path = os.path.realpath(os.path.expanduser(local))
    else:
        path = link.rstrip("/")
        if "/../" in path + "/" or "/./" in path + "/":
            return False
    return any(path == r or path.startswith(r if r.endswith("/") else r + "/") for r in roots)
