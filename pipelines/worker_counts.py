"""Live counts of a running ingest, from its workers to the driver, for its progress line
(:class:`common.progress.IngestProgress`).

Beam's metrics are no use for this: the DirectRunner (FnApiRunner) runs the whole pipeline
inside ``run()`` and returns its result, the only handle on the metrics, when everything has
finished, and Beam's DaskRunner reports none (:mod:`pipelines.dask_runner`). So each
worker process appends what it has counted to a file of its own under the run's staging
folder (one short line per event, ``written with os.write`` on an ``O_APPEND`` descriptor,
so a line is never half there for long and never interleaved), and the driver sums the
files. Every number is a count of work done; a bundle that a runner retries after a crash
is counted again, which the final summary, built from the pipeline's outputs, is not.

The channel needs the workers to share the driver's filesystem at the staging folder: the
DirectRunner, a local Dask cluster, or a remote one writing to a shared mount. On an object
store the ingest shows elapsed time only (:func:`channel_dir` returns None).
"""
from __future__ import annotations

import os
import threading
import uuid

#: What the ingest counts: source units and items read, items decoded/validated, rows written to
#: shards, items quarantined, duplicates dropped (test set and corpus).
NAMES = ("units", "inputs", "processed", "written", "rejected", "duplicates")

_fds: dict[tuple[int, str], int] = {}
_lock = threading.Lock()


def channel_dir(staging_url: str, fs) -> str | None:
    """The local folder the workers write their counts to, or None where workers cannot share one."""
    if type(fs).__name__ != "LocalFileSystem":
        return None
    path = os.path.join(fs._strip_protocol(staging_url), "progress")
    os.makedirs(path, exist_ok=True)
    return path


def count(directory: str | None, **counts: int) -> None:
    """Add ``counts`` (``inputs=16``...) to this process's file in ``directory``; None: do nothing."""
    if directory is None:
        return
    line = " ".join(f"{k}={int(v)}" for k, v in counts.items() if v) + "\n"
    if line == "\n":
        return
    key = (os.getpid(), directory)
    with _lock:
        fd = _fds.get(key)
        if fd is None:
            try:
                fd = os.open(os.path.join(directory, f"{os.getpid()}-{uuid.uuid4().hex[:8]}.counts"),
                             os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError:
                return  # the staging folder is gone (the run ended); counts are only for the line
            _fds[key] = fd
        try:
            os.write(fd, line.encode())
        except OSError:
            pass


class Totals:
    """The driver's sum of every worker's counts in a channel folder, read incrementally."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self.counts = dict.fromkeys(NAMES, 0)
        self._offsets: dict[str, int] = {}

    def poll(self) -> dict[str, int]:
        if self.directory is None:
            return self.counts
        try:
            names = os.listdir(self.directory)
        except OSError:
            return self.counts
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(name, 0))
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1  # a line still being written is read next time
            self._offsets[name] = self._offsets.get(name, 0) + end
            for line in data[:end].decode().split():
                key, _, value = line.partition("=")
                self.counts[key] = self.counts.get(key, 0) + int(value)
        return self.counts


def close(directory: str | None) -> None:
    """Close this process's file in ``directory`` (the in-process runner's workers are the driver)."""
    with _lock:
        for key in [k for k in _fds if k[1] == directory]:
            os.close(_fds.pop(key))


def known_inputs(units) -> int | None:
    """How many items ``units`` hold, when planning already listed them (files, manifests); else None."""
    from pipelines.sources import known_items

    counts = [known_items(u) for u in units]
    return None if None in counts else sum(counts)
