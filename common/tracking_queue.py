"""Metrics sent to an MLflow run from a background thread through a disk spool: training never
waits for the tracking server.

:meth:`MetricsQueue.log` stamps a record (a sequence number, the step, the time), appends it to
the spool on local disk (``metrics.jsonl``) and hands it to a bounded in-memory queue; when the
queue is full the sender reads it back from the spool. It never waits for the server and never
drops a record, even when the process is killed. The sender thread sends the records in
sequence order with ``log_batch`` and writes the last sequence number sent (``sent.json``) after
each batch. While
the server is unreachable the records stay in the spool and are sent, in order, once it answers
again, or at :meth:`MetricsQueue.close`, or by the next queue opened on the same spool (a resumed
run). A batch whose send failed may have reached the store: before it is sent again, the points
the run already holds are left out, so that each (key, step, timestamp) is logged once.

The console says once that the server is unreachable and once that it is back. MLflow's own HTTP
retries (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``..._BACKOFF_FACTOR``, ``..._TIMEOUT``) bound how
long one failed send holds the sender, not the training thread.
"""
from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Mapping

from common.fs import atomic_write

# The folder, beside a run's checkpoints, that holds one spool per MLflow run id.
SPOOL_DIR = "tracking_spool"
JOURNAL = "metrics.jsonl"
SENT = "sent.json"
# MLflow's log_batch takes at most 1000 metrics a request.
BATCH_METRICS = 1000
_THREAD = "vitscale-metrics-sender"


class _QuietSender(logging.Filter):
    """urllib3 warns on each HTTP retry; from the sender thread the console's one line says it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != _THREAD


_QUIET = _QuietSender()


def shown_uri(uri: str) -> str:
    """``uri`` without a user or password, for the console."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))


class MetricsQueue:
    """Rank 0's metrics for one MLflow run, sent from a background thread through ``spool``.

    Args:
        run_id: the MLflow run the metrics go to; it must stay active until :meth:`close`.
        uri: its tracking URI.
        spool: the folder that keeps the records until the run holds them (one per run id).
        maxsize: records held in memory; more are appended to the spool by the caller's thread.
        probe_every: seconds between looks at an unreachable server.
    """

    def __init__(self, run_id: str, *, uri: str, spool: str | Path, maxsize: int = 256,
                 probe_every: float = 5.0) -> None:
        self.run_id, self.uri, self.spool = run_id, uri, Path(spool)
        self.spool.mkdir(parents=True, exist_ok=True)
        self.probe_every = probe_every
        self._journal, self._sent_file = self.spool / JOURNAL, self.spool / SENT
        self._sent = self._read_sent()
        last = max((r["seq"] for r in self._read_journal()), default=-1)
        self._seq = max(last, self._sent) + 1
        # Records a dead predecessor left may have reached the store without being marked sent.
        self._behind = self._uncertain = last > self._sent
        self._queue: queue.Queue = queue.Queue(maxsize)
        self._lock = threading.Lock()  # sequence numbers and journal appends
        self._stop = threading.Event()
        self._down = self._refused = False
        self._next_probe = 0.0
        self.spilled = 0
        self._client: Any = None
        for name in ("urllib3.connectionpool", "urllib3.util.retry"):
            logging.getLogger(name).addFilter(_QUIET)  # once: a logger keeps one copy of a filter
        self._thread = threading.Thread(target=self._run, name=_THREAD, daemon=True)
        self._thread.start()

    # -- the training thread -----------------------------------------------------------------

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Queue ``metrics`` at ``step``, stamped now; returns at once, whatever the server does."""
        record = {"step": int(step), "timestamp": int(time.time() * 1000),
                  "metrics": {str(k): float(v) for k, v in metrics.items()}}
        with self._lock:
            record["seq"] = self._seq
            self._seq += 1
            # Written ahead, so that a worker killed with records still queued loses none of them.
            self._append([record])
            try:
                self._queue.put_nowait(record)
            except queue.Full:  # the sender finds it in the spool by the gap in the sequence
                self.spilled += 1

    def close(self, timeout: float | None = None) -> bool:
        """Send what is queued (one last try if the server is down) and stop the sender; True when
        the run holds every record. What it does not is kept in the spool, and the console says where."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():  # a send still in MLflow's retries; the journal holds every record
            print(f"tracking: MLflow at {shown_uri(self.uri)} did not take the last metrics in {timeout:g}s; "
                  f"{self.pending()} records are kept in {self.spool} and sent when the run resumes",
                  file=sys.stderr, flush=True)
        return self.pending() == 0

    @property
    def unreachable(self) -> bool:
        """Whether the last send failed and the records wait in the spool for the server."""
        return self._down

    def pending(self) -> int:
        """Records logged and not yet known to be in the run."""
        return self._seq - 1 - self._sent

    # -- the sender thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            batch = self._drain(wait=not stopping)
            if self._refused:
                if stopping and self._queue.empty():
                    break
                continue
            if self.pending() and self._probe_due(now=stopping):
                self._send(batch)
            if stopping and self._queue.empty():
                break
        if self.pending():
            print(f"tracking: {self.pending()} metric records for MLflow run {self.run_id} were not sent; they are "
                  f"kept in {self.spool} and sent when the run resumes", file=sys.stderr, flush=True)

    def _drain(self, *, wait: bool) -> list[dict]:
        out = []
        try:
            out.append(self._queue.get(timeout=0.2) if wait else self._queue.get_nowait())
            while len(out) < 512:
                out.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        return out

    def _probe_due(self, *, now: bool) -> bool:
        if not self._down:
            return True
        if not now and time.monotonic() < self._next_probe:
            return False
        self._next_probe = time.monotonic() + self.probe_every
        return self._reachable()

    def _reachable(self) -> bool:
        """Whether an HTTP server answers at all (any status): a cheap look before a send that
        would otherwise spend MLflow's whole retry budget."""
        if not self.uri.startswith(("http://", "https://")):
            return True
        import requests

        try:
            requests.get(self.uri.rstrip("/") + "/health", timeout=2)
        except requests.RequestException:
            return False
        return True

    def _send(self, batch: list[dict]) -> None:
        from mlflow.exceptions import RestException

        expected = list(range(self._sent + 1, self._sent + 1 + len(batch)))
        in_order = batch and not self._behind and [r["seq"] for r in batch] == expected
        pending = batch if in_order else self._unsent()
        sent = 0
        try:
            for chunk in _chunks(pending):
                self._log_batch(chunk)
                sent += len(chunk)
        except RestException as exc:
            if exc.get_http_status_code() < 500:
                self._refused = True
                print(f"tracking: MLflow refused metrics for run {self.run_id} ({exc}); they are kept in {self.spool}",
                      file=sys.stderr, flush=True)
            else:
                self._went_down(exc)
            return
        except Exception as exc:  # noqa: BLE001 - whatever the client raises, training goes on and the spool keeps all
            self._went_down(exc)
            return
        self._behind = False
        if self._down:
            self._down = False
            print(f"tracking: MLflow at {shown_uri(self.uri)} is back; {sent} metric records sent from {self.spool}",
                  file=sys.stderr, flush=True)
        self._compact()

    def _log_batch(self, chunk: list[dict]) -> None:
        from mlflow.entities import Metric

        if self._client is None:
            import mlflow

            self._client = mlflow.MlflowClient(self.uri)
        points = [(k, v, r["timestamp"], r["step"]) for r in chunk for k, v in r["metrics"].items()]
        if self._uncertain:
            held = self._held(points)
            points = [p for p in points if (p[0], p[3], p[2]) not in held]
        if points:
            self._client.log_batch(self.run_id, metrics=[Metric(*p) for p in points])
        self._uncertain = False
        self._sent = chunk[-1]["seq"]
        atomic_write(self._sent_file, json.dumps({"run_id": self.run_id, "seq": self._sent}))

    def _held(self, points: list[tuple]) -> set[tuple[str, int, int]]:
        """(key, step, timestamp) of the run's points among ``points``' keys."""
        return {(m.key, m.step, m.timestamp) for key in {p[0] for p in points}
                for m in self._client.get_metric_history(self.run_id, key)}

    def _went_down(self, exc: BaseException) -> None:
        self._behind = self._uncertain = True
        self._next_probe = time.monotonic() + self.probe_every
        if not self._down:
            self._down = True
            reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            print(f"tracking: MLflow at {shown_uri(self.uri)} is unreachable ({reason}); training goes on, and "
                  f"metrics are kept in {self.spool} until it answers", file=sys.stderr, flush=True)

    # -- the spool ---------------------------------------------------------------------------

    def _append(self, records: list[dict]) -> None:
        with open(self._journal, "a") as f:
            f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))

    def _read_journal(self) -> list[dict]:
        try:
            lines = self._journal.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # the last line of a process killed mid-write
                continue
        return out

    def _read_sent(self) -> int:
        try:
            return int(json.loads(self._sent_file.read_text())["seq"])
        except FileNotFoundError:
            return -1
        except (OSError, ValueError, KeyError, TypeError):
            # Unknown: everything is sent again, and what the run holds already is left out.
            return -1

    def _unsent(self) -> list[dict]:
        with self._lock:
            records = self._read_journal()
        return sorted((r for r in records if r["seq"] > self._sent), key=lambda r: r["seq"])

    def _compact(self) -> None:
        """Empty the journal once the run holds everything in it."""
        with self._lock:
            if self._sent == self._seq - 1:
                self._journal.write_text("")


def _chunks(records: list[dict]) -> list[list[dict]]:
    out: list[list[dict]] = []
    size = BATCH_METRICS
    for r in records:
        n = len(r["metrics"])
        if size + n > BATCH_METRICS:
            out.append([])
            size = 0
        out[-1].append(r)
        size += n
    return out
