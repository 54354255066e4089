"""Room on the output's disk for a ``prepare`` run: the estimate before it starts, and one line when the disk fills.

The output folder holds the images twice while the job runs (the staging folder's spill files,
then the shards) besides the set already there, so the estimate is twice the inputs' bytes. It is
an upper bound for a corpus that ``--size`` shrinks, and known only for inputs on a local disk.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sys
from typing import Sequence

from common.disk import disk_error
from common.fs import is_local, url_to_fs


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def input_bytes(inputs: Sequence[str]) -> int | None:
    """The bytes of the inputs' files, or None when an input is not on a local disk."""
    total = 0
    for src in inputs:
        fs, path = url_to_fs(src)
        if not is_local(fs):
            return None
        if os.path.isfile(path):
            total += os.path.getsize(path)
        for root, _, files in os.walk(path, followlinks=True):
            total += sum(os.path.getsize(p) for f in files if os.path.isfile(p := os.path.join(root, f)))
    return total


def free_bytes(url: str) -> int | None:
    fs, path = url_to_fs(url)
    if not is_local(fs):
        return None
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def need_bytes(inputs: Sequence[str]) -> int | None:
    n = input_bytes(inputs)
    return None if n is None else 2 * n


def warn_if_short(output: str, inputs: Sequence[str]) -> None:
    """One line on stderr when the output's disk has less room than the run may need."""
    need, free = need_bytes(inputs), free_bytes(output)
    if need is not None and free is not None and free < need:
        print(f"prepare: warning: output {output}: {_mb(free)} free, and this run may need up to {_mb(need)} "
              "(twice the inputs' bytes); free some space or choose another --output if it fails", file=sys.stderr)


class _DiskErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return disk_error(exc) is None and "[Errno 28]" not in record.getMessage()


@contextlib.contextmanager
def quiet_disk_errors():
    """Beam logs a worker's error with its traceback before it raises it: a full disk is said in
    one line instead (:func:`disk_message`)."""
    logger, quiet = logging.getLogger("apache_beam.runners.common"), _DiskErrors()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def disk_message(code: int, output: str, inputs: Sequence[str]) -> str:
    """The one line for a prepare the disk stopped: the path, the free space and the need."""
    if code == errno.EROFS:
        return f"output {output}: the file system became read-only while writing; give a writable --output"
    free, need = free_bytes(output), need_bytes(inputs)
    room = f"{_mb(free)} free" if free is not None else "free space unknown"
    want = f", and this run needs up to {_mb(need)} (twice the inputs' bytes)" if need is not None else ""
    return (f"output {output}: the disk is full ({room}{want}); any set already there is kept and this run's "
            "staging folders are removed; free some space or choose another --output, then run again")
