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
    - Otherwise: start Ray in-process, bound to 127.0.0.1, without the dashboard.

    Workers import this repository's packages (``vitcore``, ``pipelines``, ``vitscale``), so
    an in-process start puts the repository root on their ``PYTHONPATH``.
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=log_to_driver)
        return
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


def cpus_available() -> int:
    import ray

    return int(ray.cluster_resources().get("CPU", 1))
