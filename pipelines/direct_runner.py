"""The DirectRunner's multi-worker modes: no lost elements, kept to this machine, and quiet.

**Lost elements.** Beam 2.77's time-based flush of the runner-worker data streams
(``worker_handlers.DATA_BUFFER_TIME_LIMIT_MS``) races with the bundle thread and silently
drops what is written between its ``get()`` and ``_clear()``. :func:`flush_by_size_only`
sets the limit to 0, so the streams flush only between elements, on size, and at the end
of a bundle; batch pipelines lose nothing by it (the limit exists for streaming latency).
The check that measures it after a Beam upgrade: ``benchmarks/README.md``.

**Loopback.** With ``--workers N`` (N > 1) Beam's DirectRunner starts N workers and
serves them control, data, state and logging over gRPC. Beam 2.77 binds those
servers to every interface (``[::]:0``) without authentication, so for the
length of a run anyone who can reach this machine could connect to them. Like
Ray and MLflow in their embedded modes, they should listen on loopback only.

:func:`bind_servers_to_loopback` makes the Beam modules that start these
servers bind ``localhost`` instead of the wildcard address. Their workers
already connect to ``localhost:PORT``, so nothing else changes. Remote workers
(a Docker ``--environment_type``, a portable job server) need the wildcard
address; the ingest leaves those runs alone.

:data:`QUIET_WORKER_FLAGS` keeps the workers' own start-up and shutdown chatter
(about 50 INFO and WARNING lines a run: optional GCP clients not installed,
the options they discard, the harness starting and exiting) off the user's
terminal, while warnings from this project's modules still reach it.
"""
from __future__ import annotations

import json
import threading
from typing import Any

_WILDCARDS = ("[::]", "0.0.0.0", "")
_lock = threading.Lock()

QUIET_WORKER_FLAGS = (
    "--default_sdk_harness_log_level=ERROR",
    "--sdk_harness_log_level_overrides=" + json.dumps({name: "WARNING" for name in ("pipelines", "dedup")}),
)


def loopback_address(address: str) -> str:
    """``address`` with a wildcard host replaced by ``localhost`` (both loopback families, one port)."""
    host, sep, port = address.rpartition(":")
    if sep and host in _WILDCARDS:
        return f"localhost:{port}"
    return address


class _LoopbackServer:
    """A ``grpc.Server`` whose insecure ports bind loopback instead of every interface."""

    def __init__(self, server):
        self._server = server

    def add_insecure_port(self, address: str) -> int:
        return self._server.add_insecure_port(loopback_address(address))

    def __getattr__(self, name):
        return getattr(self._server, name)


class _LoopbackGrpc:
    """Stands in for the ``grpc`` module inside a Beam module; only ``server()`` differs."""

    def __init__(self, grpc_module):
        self._grpc = grpc_module

    def server(self, *args, **kwargs):
        return _LoopbackServer(self._grpc.server(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self._grpc, name)


def direct_runner(options):
    """Beam's DirectRunner without its attempt at Prism: the FnApiRunner, set up as the DirectRunner sets it up.

    Beam 2.77's ``DirectRunner`` first tries ``PrismRunner``, which downloads a binary
    from GitHub when none is cached. Offline that fails and it falls back to the
    FnApiRunner, leaving an empty ``beam-temp*`` folder in the temp dir each run; online
    the ingest would run on Prism, which none of this module's fixes or the tests cover.
    The provision info carries the pipeline options to the SDK workers, as the
    DirectRunner's fallback does (:data:`QUIET_WORKER_FLAGS` reach them that way).
    """
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from apache_beam.runners.portability.portable_runner import JobServiceHandle

    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
    return fn_runner.FnApiRunner(provision_info=fn_runner.ExtendedProvisionInfo(
        beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)))


def flush_by_size_only() -> None:
    """Turn off the DirectRunner's time-based data flushing, which drops elements (idempotent)."""
    from apache_beam.runners.portability.fn_api_runner import worker_handlers

    # Read when the runner builds its data servicer and its embedded workers, so set before a run.
    worker_handlers.DATA_BUFFER_TIME_LIMIT_MS = 0


def bind_servers_to_loopback() -> None:
    """Make the DirectRunner's gRPC servers in this process listen on loopback only (idempotent)."""
    from apache_beam.runners.portability import abstract_job_service, local_job_service
    from apache_beam.runners.portability.fn_api_runner import worker_handlers
    from apache_beam.runners.worker import worker_pool_main

    with _lock:
        # worker_handlers: control, data, state, logging; local_job_service: each
        # worker's logging server; worker_pool_main: the pool the runner starts
        # for loopback environments; abstract_job_service: artifact staging.
        for module in (worker_handlers, local_job_service, worker_pool_main, abstract_job_service):
            if not isinstance(module.grpc, _LoopbackGrpc):
                module.grpc = _LoopbackGrpc(module.grpc)


class _SessionSubprocess:
    """Stands in for ``subprocess`` inside ``local_job_service``: each SDK worker starts in its own session."""

    def Popen(self, *args, **kwargs):
        import subprocess

        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(*args, **kwargs)

    def __getattr__(self, name):
        import subprocess

        return getattr(subprocess, name)


def workers_in_own_session() -> None:
    """Start the DirectRunner's SDK workers outside the terminal's process group (idempotent).

    A terminal's Ctrl-C reaches the whole group: each worker printed its own
    KeyboardInterrupt and gRPC tracebacks over the driver's one line. Outside the group only the driver gets the signal, and
    :class:`WorkerReaper` ends the workers; a driver killed outright still
    takes them with it, as their control stream closes.
    """
    from apache_beam.runners.portability import local_job_service

    with _lock:
        if not isinstance(local_job_service.subprocess, _SessionSubprocess):
            local_job_service.subprocess = _SessionSubprocess()


class WorkerReaper:
    """Ends an interrupted run's DirectRunner work quietly; called by :func:`common.cli.interrupts`.

    Beam's teardown joins a thread that waits on each SDK worker process, and a worker
    exits only when its control stream closes, which that teardown has not reached:
    a SIGINT or SIGTERM sent to the driver alone left ``prepare`` waiting forever. So the
    workers are killed, and killed again until :meth:`close`: one still being started
    when the signal came would otherwise be waited on for good.
    The teardown's threads then log the broken streams; the run is ending with its one line
    (``common.cli.run_job``), so their logs and thread tracebacks are dropped until :meth:`close`,
    which gives the process its logging and thread excepthook back.
    """

    def __init__(self) -> None:
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._muted: tuple[int, Any] | None = None

    def __call__(self, signum: int | None = None) -> None:
        import logging

        if self._muted is None:
            self._muted = (logging.root.manager.disable, threading.excepthook)
        logging.disable(logging.CRITICAL)
        threading.excepthook = lambda args: None
        self._kill()
        if self._thread is None:
            self._thread = threading.Thread(target=self._reap, name="sdk-worker-reaper", daemon=True)
            self._thread.start()

    def close(self) -> None:
        import logging

        self._done.set()
        if self._muted is not None:
            level, hook = self._muted
            logging.disable(level)
            threading.excepthook = hook
            self._muted = None

    def _reap(self) -> None:
        while not self._done.wait(0.1):
            self._kill()

    @staticmethod
    def _kill() -> None:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                if any("sdk_worker_main" in part for part in child.cmdline()):
                    child.kill()
            except psutil.Error:
                pass
