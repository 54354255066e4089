"""common.tracking_queue: metrics reach the run once each, in step order, whatever the tracking
server does; the caller's ``log`` never waits for it."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import requests

from common.tracking_queue import JOURNAL, MetricsQueue

KEYS = ("train_loss", "lr")
# Generous: a ``log`` call that waited on the server would wait for MLflow's retries (seconds).
LIVENESS_S = 2.0


@pytest.fixture
def low_retry_budget(monkeypatch):
    """MLflow's HTTP retry budget cut from minutes to about a second, so that a test outlives it."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")


def _start_server(store: Path, port: int) -> subprocess.Popen:
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite store, answering /health."""
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "PATH": "/usr/bin:/bin"}
    log = open(store / "server.log", "a")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
         "--default-artifact-root", (store / "artifacts").as_uri(), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, (store / "server.log").read_text()[-3000:]
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return proc
            except requests.RequestException:
                pass
            time.sleep(0.3)
        pytest.fail(f"mlflow server did not answer in 180s: {(store / 'server.log').read_text()[-3000:]}")
    except BaseException:  # a failed start, or the run stopped while it waited: no server outlives the test
        if proc.poll() is None:
            _kill(proc)
        raise


def _kill(proc: subprocess.Popen) -> None:
    import os
    import signal

    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _new_run(uri: str) -> str:
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment(f"queue-{time.time_ns()}")
    return client.create_run(exp).info.run_id


def _history(uri: str, run_id: str) -> dict[str, list[int]]:
    client = mlflow.MlflowClient(uri)
    return {k: [m.step for m in sorted(client.get_metric_history(run_id, k), key=lambda m: (m.step, m.timestamp))]
            for k in KEYS}


def _log(q: MetricsQueue, steps: range) -> float:
    """Log ``steps``; the longest a ``log`` call took."""
    slowest = 0.0
    for step in steps:
        t = time.perf_counter()
        q.log({"train_loss": 1.0 / (step + 1), "lr": 0.1}, step)
        slowest = max(slowest, time.perf_counter() - t)
    return slowest


def _wait(condition, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_server_killed_past_the_retry_budget_and_restarted_gets_every_metric_once_in_order(
        tmp_path, free_port, low_retry_budget, capfd):
    port, store = free_port(), tmp_path / "server"
    store.mkdir()
    uri = f"http://127.0.0.1:{port}"
    server = _start_server(store, port)
    try:
        run_id = _new_run(uri)
        q = MetricsQueue(run_id, uri=uri, spool=tmp_path / "spool", probe_every=0.2)
        _log(q, range(0, 10))
        _wait(lambda: q.pending() == 0)
        _kill(server)
        slowest = _log(q, range(10, 20))
        # Past MLflow's retry budget: the sender has failed at least once, and training logs on.
        _wait(lambda: q.unreachable, 60)
        for first in range(20, 60, 10):
            slowest = max(slowest, _log(q, range(first, first + 10)))
            time.sleep(0.5)
        assert slowest < LIVENESS_S
        assert q.pending() > 0
        server = _start_server(store, port)
        assert q.close(timeout=120)
        assert _history(uri, run_id) == {k: list(range(60)) for k in KEYS}
        err = capfd.readouterr().err
        assert err.count("is unreachable") == 1 and err.count("is back") == 1, err
        assert "Retrying" not in err, err
    finally:
        if server.poll() is None:
            _kill(server)


def test_a_full_queue_spills_to_the_spool_and_a_later_queue_sends_it_all_in_order(tmp_path,
                                                                                    low_retry_budget, capfd):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = _new_run(store)
    spool = tmp_path / "spool"
    # A server that takes connections and never answers: the sender waits in its first send (MLflow's
    # timeout), so the queue fills whatever the machine's speed. A closed port refuses at once, and
    # the sender could then drain the queue as fast as the caller fills it.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(256)
        down = MetricsQueue(run_id, uri=f"http://127.0.0.1:{silent.getsockname()[1]}", spool=spool, maxsize=4,
                            probe_every=0.2)
        slowest = _log(down, range(200))
        assert slowest < LIVENESS_S
        assert not down.close(timeout=120)
    assert down.spilled > 0
    kept = sorted(json.loads(line)["step"] for line in (spool / JOURNAL).read_text().splitlines())
    assert kept == list(range(200))  # nothing dropped
    assert f"200 metric records for MLflow run {run_id} were not sent; they are kept in {spool}" in capfd.readouterr().err

    resumed = MetricsQueue(run_id, uri=store, spool=spool)
    _log(resumed, range(200, 210))
    assert resumed.close(timeout=120)
    assert _history(store, run_id) == {k: list(range(210)) for k in KEYS}
    assert (spool / JOURNAL).read_text() == ""


def test_records_sent_but_not_marked_sent_are_not_logged_twice(tmp_path):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = _new_run(store)
    spool = tmp_path / "spool"
    first = MetricsQueue(run_id, uri=store, spool=spool)
    _log(first, range(10))
    assert first.close(timeout=120)
    # A process killed after log_batch returned and before it wrote down what it sent.
    lines = [json.dumps({"seq": s, "step": s, "timestamp": 1_000 + s, "metrics": {"train_loss": 1.0, "lr": 0.1}})
             for s in range(10, 15)]
    (spool / JOURNAL).write_text("\n".join(lines) + "\n")
    mlflow.MlflowClient(store).log_batch(run_id, metrics=[
        mlflow.entities.Metric(k, 1.0 if k == "train_loss" else 0.1, 1_000 + s, s) for s in range(10, 13) for k in KEYS])
    (spool / "sent.json").write_text(json.dumps({"run_id": run_id, "seq": 9}))

    second = MetricsQueue(run_id, uri=store, spool=spool)
    assert second.close(timeout=120)
    assert _history(store, run_id) == {k: list(range(15)) for k in KEYS}
