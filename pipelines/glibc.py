"""glibc's allocator settings, the one place the ingest calls the C library.

Both ingest runners keep freed memory that the system should have back: the multi-worker
DirectRunner's driver passes every element through large buffers (:func:`mmap_threshold_pinned`),
and a Dask worker decodes images between long-lived small objects
(:func:`pipelines.dask_runner.give_back_freed_memory`). Why each is needed, with its figures:
``docs/ingest.md`` and ``docs/scale-out.md``; the measurements: ``benchmarks/README.md``.
Where the C library has neither call (macOS, musl), nothing is set and the callers carry on.
"""
from __future__ import annotations

import contextlib
import ctypes
from typing import Iterator

#: glibc's ``mallopt`` parameter for the mmap threshold (``M_MMAP_THRESHOLD`` in malloc.h).
_M_MMAP_THRESHOLD = -3
#: glibc's initial threshold: a block this large or larger is its own mapping, unmapped when freed.
MMAP_THRESHOLD = 128 * 1024
#: Where glibc's dynamic threshold stops rising on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``).
THRESHOLD_CEILING = 32 * 1024 * 1024


def _libc(name: str):
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold in this process, so that freed large buffers go back to the system.

    glibc raises the threshold to the size of each mapped block freed (up to
    :data:`THRESHOLD_CEILING`); blocks below it then come from the heap, which keeps them
    while anything still lives above them. Returns whether it was set.
    """
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, threshold) == 1


@contextlib.contextmanager
def mmap_threshold_pinned(threshold: int = MMAP_THRESHOLD) -> Iterator[bool]:
    """:func:`pin_mmap_threshold` for the length of the block; yields whether it was set.

    The setting is process-wide, and a small fixed threshold slows numerical work that maps and
    unmaps its large arrays each time (CPU training in the same process, as in the demo). So
    at the end the threshold goes to :data:`THRESHOLD_CEILING`, where glibc's own one climbs to.
    """
    pinned = pin_mmap_threshold(threshold)
    try:
        yield pinned
    finally:
        if pinned:
            pin_mmap_threshold(THRESHOLD_CEILING)


def malloc_trim() -> bool:
    """Hand the free pages inside glibc's heaps back to the system; returns whether it ran."""
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    trim(0)
    return True
