"""Where the ingest runs: the runner ``--runner`` names, its Beam options, and the engine behind it.

- **DirectRunner** (``direct``): in this process with ``--workers 1``, else that many local SDK
  worker processes, patched by :mod:`pipelines.direct_runner` (no lost elements, loopback
  servers, quiet workers) and with glibc's mmap threshold pinned in the driver
  (:mod:`pipelines.glibc`).
- **dask**: Beam's DaskRunner with :mod:`pipelines.dask_runner`'s fixes, on the scheduler at
  ``--dask-address`` or on a local cluster started for the job's length.
- **Anything else** (Dataflow, Flink, ...): Beam's own, with ``--beam-options``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Iterator

from pipelines import direct_runner, glibc
from pipelines.config import NAMESPACE, PrepareConfig, PrepareError

log = logging.getLogger(__name__)


def is_direct(cfg: PrepareConfig) -> bool:
    return cfg.runner in ("DirectRunner", "direct")


def in_process(cfg: PrepareConfig) -> bool:
    """Whether every step runs in this process: the DirectRunner's in-memory mode (``--workers 1``)."""
    return is_direct(cfg) and cfg.workers == 1


def is_dask(cfg: PrepareConfig) -> bool:
    return cfg.runner == "dask"


def check_process_local(cfg: PrepareConfig) -> None:
    """``memory://`` lives in one process: Beam workers elsewhere would read and write empty copies.

    Test sets may stay there: their index is built here, in the driver, and shipped to the workers.
    """
    if in_process(cfg):
        return
    for what, url in [("output", cfg.output), *(("input", u) for u in cfg.input)]:
        if str(url).startswith("memory://"):
            if not is_direct(cfg):
                raise PrepareError(
                    f"{what} {url}: memory:// exists only inside this process, but --runner {cfg.runner} runs the "
                    "work in other processes; use a filesystem every worker shares (a mount or an object store URL)"
                )
            raise PrepareError(
                f"{what} {url}: memory:// exists only inside this process, but the {cfg.runner} with "
                f"--workers {cfg.workers} runs the work in other processes; use --workers 1 or a shared filesystem"
            )


def check_dask(cfg: PrepareConfig) -> int | None:
    """With ``--runner dask``: the number of workers its scheduler has, or a PrepareError if none answers."""
    if not is_dask(cfg):
        return None
    try:
        from pipelines import dask_runner
    except ImportError as exc:
        raise PrepareError(
            f"--runner dask needs dask.distributed ({exc}); install the extra: pip install -c constraints.txt '.[dask]'"
        ) from None
    try:
        if cfg.dask_address is None:
            return cfg.workers
        timeout = next((float(o.split("=", 1)[1]) for o in cfg.beam_options
                        if o.startswith("--dask_connection_timeout=")), dask_runner.CONNECT_TIMEOUT_S)
        workers = dask_runner.connect(cfg.dask_address, timeout)
    except dask_runner.DaskUnavailable as exc:
        raise PrepareError(str(exc)) from None
    if workers == 0:
        log.warning("prepare: the Dask scheduler at %s has no workers yet; the job waits for them", cfg.dask_address)
    return workers


@dataclasses.dataclass
class Engine:
    address: str | None  # the Dask scheduler, when the runner is dask
    workers: int  # worker processes, for the per-worker rate
    startup_s: float  # starting a local cluster, if one was started


@contextlib.contextmanager
def engine(cfg: PrepareConfig, cluster_workers: int | None) -> Iterator[Engine]:
    """Where the pipeline runs: for ``--runner dask`` without an address, a local cluster for the job's length."""
    t0 = time.perf_counter()
    if is_dask(cfg) and cfg.dask_address is None:
        from pipelines import dask_runner

        with dask_runner.local_cluster(cfg.workers) as address:
            yield Engine(address, cfg.workers, time.perf_counter() - t0)
        return
    yield Engine(cfg.dask_address, cluster_workers or cfg.workers, 0.0)


def _direct_flags(cfg: PrepareConfig) -> list[str]:
    # One worker runs in-process: the multi-process mode costs seconds of
    # start-up that a few hundred images do not repay.
    mode = "in_memory" if in_process(cfg) else "multi_processing"
    flags = [f"--direct_num_workers={cfg.workers}", f"--direct_running_mode={mode}"]
    if not in_process(cfg):
        direct_runner.flush_by_size_only()  # Beam's periodic flush drops elements (pipelines.direct_runner)
    if not in_process(cfg) and not any(o.startswith("--environment_type") for o in cfg.beam_options):
        # Local worker processes: serve them on loopback only, and keep their
        # start-up chatter off the terminal (a user's own flags come later and win).
        direct_runner.bind_servers_to_loopback()
        direct_runner.workers_in_own_session()
        flags += direct_runner.QUIET_WORKER_FLAGS
    return flags


def pipeline_options(cfg: PrepareConfig, *, dask_address: str | None = None, partitions: int | None = None):
    """Beam options for ``cfg``; on Dask, ``dask_address`` is the scheduler and ``partitions`` the plan's chunks."""
    from apache_beam.options.pipeline_options import PipelineOptions

    if is_dask(cfg):
        from pipelines import dask_runner

        flags = [f"--runner={dask_runner.RUNNER}", f"--dask_client_address={dask_address or cfg.dask_address}"]
        if partitions:
            # One Dask partition per plan chunk (one source unit each for a small corpus): Beam's
            # default packs up to 128 elements per partition, which would give a small corpus one task.
            flags.append(f"--dask_npartitions={partitions}")
        return PipelineOptions(flags + list(cfg.beam_options))
    flags = [f"--runner={cfg.runner}"]
    if is_direct(cfg):
        flags += _direct_flags(cfg)
    return PipelineOptions(flags + list(cfg.beam_options))


@contextlib.contextmanager
def pipeline(cfg: PrepareConfig, options) -> Iterator:
    """A ``beam.Pipeline`` on ``cfg``'s runner, run when the block ends.

    The multi-worker DirectRunner's driver pins glibc's mmap threshold while it runs, so the
    buffers each element passes through go back to the system when freed (docs/ingest.md).
    """
    import apache_beam as beam

    runner = direct_runner.direct_runner(options) if is_direct(cfg) else None
    pinned = glibc.mmap_threshold_pinned() if is_direct(cfg) and not in_process(cfg) else contextlib.nullcontext()
    with pinned, beam.Pipeline(runner=runner, options=options) as p:
        yield p


def retry_config(cfg: PrepareConfig) -> PrepareConfig:
    """The config of a run after an accounting mismatch: in one process where several DirectRunner
    workers ran, since the multi-worker streams are the ones seen losing elements; the pipeline is
    deterministic, so its shards are exactly those of a clean first run."""
    if is_direct(cfg) and not in_process(cfg):
        return dataclasses.replace(cfg, workers=1)
    return cfg


def beam_counters(p, cfg: PrepareConfig) -> dict[str, float]:
    """Beam's counters of the finished pipeline ``p``; none on Dask, whose runner reports no metrics."""
    if is_dask(cfg):
        return {}
    try:
        from apache_beam.metrics.metric import MetricsFilter

        result = p.result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))
        out: dict[str, float] = {}
        for c in result["counters"]:
            out[c.key.metric.name] = out.get(c.key.metric.name, 0) + (c.committed or c.attempted or 0)
        return out
    except Exception as exc:  # some runners do not report metrics; the counts come from outputs anyway
        log.warning("Beam metrics unavailable: %s", exc)
        return {}
