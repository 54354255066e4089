"""Connecting to Ray the same way from a laptop, a test session, `ray job submit` and a cluster."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def init_ray(address: str | None = None, *, num_cpus: int | None = None, log_to_driver: bool = True) -> None:
    """Connect to Ray once.

    - Already connected (a test session, a Tune trial): nothing to do.
    - ``address`` given, or ``RAY_ADDRESS`` set (as inside ``ray job submit``): connect to that
      cluster. Clusters started with ``ray start --head`` use token auth: export
      ``RAY_AUTH_MODE=token`` before starting Python (Ray reads it at import, so setting it
      here would be too late); the token is read from ``~/.ray/auth_token``.
    - Otherwise: start Ray in-process on loopback only (:func:`_loopback_node`), without
      the dashboard.

    Workers import this repository's packages (``common``, ``vitcore``, ``pipelines``, ``training``), so
    an in-process start puts the repository root on their ``PYTHONPATH``.
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=log_to_driver)
        return
    _loopback_node()
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
        log_to_driver=log_to_driver,
        configure_logging=True,
        logging_level="WARNING",
    )


def _loopback_node() -> None:
    """Make the next in-process ``ray.init`` put every Ray server on loopback.

    Ray 2.60 replaces ``_node_ip_address="127.0.0.1"`` by the machine's external
    address (``services.resolve_ip_for_localhost``), and its GCS, raylet, agents and
    workers then listen there or on every interface. It keeps loopback when
    multi-node clusters are off, which the ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``
    variable decides once, when Ray is imported; setting the resulting module
    constant here works whenever Ray was imported, and leaves the environment of
    child processes (a ``ray start`` a user runs from here) alone. The processes
    this start spawns are given the node address, so they follow. A single-node
    start never needs another machine to reach it.

    Not covered: with several Ray Train workers, torch's rendezvous store on rank 0
    listens on every interface (torch 2.13 has no bind address for it).
    """
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def cpus_available() -> int:
    import ray

    return int(ray.cluster_resources().get("CPU", 1))


class ProgressBoard:
    """A Ray actor that workers post progress rows to and the driver takes them from.

    The driver prints them (:class:`common.progress.ProgressLine`), so progress reaches the
    console of whoever started the job, whether or not Ray forwards worker output
    (``log_to_driver``), with no worker prefix, and once however many ranks there are.
    Start it with ``ray.remote(num_cpus=0)(ProgressBoard).remote()``.
    """

    def __init__(self) -> None:
        self._rows: list[dict] = []

    def post(self, row: dict) -> None:
        self._rows.append(row)

    def take(self) -> list[dict]:
        rows, self._rows = self._rows, []
        return rows
