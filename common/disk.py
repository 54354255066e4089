"""A full or read-only disk, found in whatever a stage raised, said in one line.

Ray and Beam hand a worker's ``OSError`` back wrapped in their own errors, sometimes as text only
(pyarrow writes ``[errno 28]``, Python ``[Errno 28]``), so the search walks causes, contexts and
Ray Train's ``worker_failures``, and reads the text when no ``OSError`` is left.
"""
from __future__ import annotations

import errno
import os
import re
import shutil

from common.config import InputError

_CODES = (errno.ENOSPC, errno.EROFS)
_TEXT = {errno.ENOSPC: ("no space left on device",), errno.EROFS: ("read-only file system",)}
_PATH = re.compile(r"(?:No space left on device|Read-only file system)[^'\"]*['\"]([^'\"]+)['\"]", re.IGNORECASE)


class DiskFull(InputError):
    """A stage stopped by a full or read-only disk: ``line`` names the path and its free space,
    ``kept`` (when the stage knows) what it kept to resume from. The CLI adds the command."""

    def __init__(self, line: str, kept: str | None = None):
        super().__init__(line)
        self.line, self.kept = line, kept


def _chain(exc: BaseException | None):
    seen, todo = set(), [exc]
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        todo += [exc.__cause__, exc.__context__, getattr(exc, "cause", None)]
        todo += list((getattr(exc, "worker_failures", None) or {}).values())


def disk_error(exc: BaseException | None) -> int | None:
    """``errno.ENOSPC`` or ``errno.EROFS`` when ``exc`` is one or wraps one; None otherwise."""
    return (_found(exc) or (None, None))[0]


def _found(exc: BaseException | None) -> tuple[int, str | None] | None:
    """(code, path) of the first disk error in ``exc``'s chain; the path when it is known."""
    for seen in _chain(exc):
        if isinstance(seen, OSError) and seen.errno in _CODES:
            return seen.errno, seen.filename if isinstance(seen.filename, str) else None
    for seen in _chain(exc):
        text = str(seen)
        for code in _CODES:
            if f"[errno {code}]" in text.lower() or any(t in text.lower() for t in _TEXT[code]):
                match = _PATH.search(text)
                return code, match.group(1) if match else None
    return None


def free_space(path: str) -> int | None:
    """Free bytes on the disk that holds ``path``, or the nearest folder above it that exists."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path.rstrip("/"))
        if parent == path:
            break
        path = parent
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def disk_line(exc: BaseException, where: str | None = None) -> str | None:
    """One line for a disk error in ``exc``: what happened, the path, and the free space there.
    ``where`` names the path when the error does not (a Ray error's text may lose it)."""
    found = _found(exc)
    if found is None:
        return None
    code, path = found
    path = path or where
    if code == errno.EROFS:
        return f"{path or 'the output'} is on a read-only file system; give a writable folder"
    free = free_space(path) if path else None
    room = f" ({free / 1e6:,.1f} MB free there)" if free is not None else ""
    return f"no space left on the disk writing {path or 'the output'}{room}; free some space"
