"""Live counts of a running ingest, for its progress line.

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
    if all(u.kind in ("files", "error") for u in units):
        return sum(len(u.uris) if u.kind == "files" else 1 for u in units)
    return None


class IngestProgress:
    """The ``prepare`` progress line: counts from :class:`Totals`, a rate and an ETA.

    The rate is items decoded and validated per second since the last look that found no
    work started (worker start-up excluded); the ETA is the items left at that rate, shown while the total is
    known (from the plan, else from the units read) and items are left to process.
    """

    def __init__(self, line, directory: str | None, units: list, *, clock=None) -> None:
        import time

        self.line, self.totals = line, Totals(directory)
        self.units, self.inputs_total = len(units), known_inputs(units)
        self._clock = clock or time.monotonic
        self.t0 = self._clock()
        self._first: float | None = None
        self._empty = self.t0
        self._processed = (0, 0.0)  # the last processed count and when it was first seen

    def text(self) -> str:
        from common.progress import duration, eta_text

        c = self.totals.poll()
        now = self._clock()
        if self.totals.directory is None:
            return f"running for {duration(now - self.t0)} (live counts need the staging folder on a local or mounted filesystem)"
        if not c["units"]:
            self._empty = now
            return f"starting ({duration(now - self.t0)})"
        if self._first is None:
            self._first = self._empty  # the work began after the last look that found none
        if c["processed"] != self._processed[0]:
            self._processed = (c["processed"], now)
        # The rate of decoding while it lasts; it stays put while the shards are written.
        elapsed = self._processed[1] - self._first
        rate = c["processed"] / elapsed if elapsed > 0 else 0.0
        seen = f"{c['inputs']}/{self.inputs_total}" if self.inputs_total is not None else f"{c['inputs']}"
        parts = [f"{seen} inputs seen" + ("" if self.inputs_total is not None else f" ({c['units']}/{self.units} units)"),
                 f"{c['processed']} processed", f"{c['written']} written", f"{c['rejected']} quarantined",
                 f"{c['duplicates']} duplicates"]
        text = ", ".join(parts) + f"; {rate:.1f} img/s"
        total = self.inputs_total if self.inputs_total is not None else (
            c["inputs"] * self.units / c["units"] if c["units"] else None)
        if c["processed"] < (total or 0):
            text += eta_text(c["processed"], total, now - self._first)
        elif c["units"] == self.units and c["processed"] >= c["inputs"]:
            accounted = c["written"] + c["rejected"] + c["duplicates"] >= c["inputs"]
            text += "; every item accounted for, the runner is finishing" if accounted else "; writing shards"
        return text + f" ({duration(now - self.t0)} in)"

    def tick(self) -> None:
        self.line.update(self.text())

    def finish(self) -> dict[str, int]:
        """Write the last line: the totals the workers counted over the whole run."""
        from common.progress import duration

        c = dict(self.totals.poll())
        wall = self._clock() - self.t0
        self.line.close(
            f"done in {duration(wall)}: {c['inputs']} inputs, {c['written']} written, {c['rejected']} quarantined, "
            f"{c['duplicates']} duplicates; {c['inputs'] / wall if wall > 0 else 0.0:.1f} img/s overall"
            if self.totals.directory is not None else f"done in {duration(wall)}")
        close(self.totals.directory)
        return c
