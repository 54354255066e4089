"""Connecting to Ray the same way from a laptop, a test session, `ray job submit` and a cluster, and
reading back what a finished Ray Train fit or Tune trial reported."""
from __future__ import annotations

import json
import os
import posixpath
import shutil
import sys
from pathlib import Path

import pyarrow.fs

from common.config import ConfigError
from common.fs import atomic_open

REPO_ROOT = Path(__file__).resolve().parents[1]


# Ray Train's settings for the one node of an in-process start; a variable set in the environment
# wins. Each fit starts one process fewer (benchmarks/fit_startup.py counts them):
# - no preemption watcher, an actor (a process) per fit that waits for a cluster to drain a node;
# - the controller polls its workers every 0.5 s, not 2 s: a fit's phases (workers placed, started,
#   finished) are each seen at the next poll. A poll that misses is waited on, not a failure.
ONE_NODE_TRAIN = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


def init_ray(address: str | None = None, *, num_cpus: int | None = None, log_to_driver: bool = True) -> bool:
    """Connect to Ray once.

    - Already connected (a test session, a Tune trial): nothing to do.
    - ``address`` given, or ``RAY_ADDRESS`` set (as inside ``ray job submit``): connect to that
      cluster. Clusters started with ``ray start --head`` use token auth: export
      ``RAY_AUTH_MODE=token`` before starting Python (Ray reads it at import, so setting it
      here would be too late); the token is read from ``~/.ray/auth_token``.
    - Otherwise: start Ray in-process on loopback only (:func:`_loopback_node`), without
      the dashboard, with Ray Train set for one node (:data:`ONE_NODE_TRAIN`).

    Returns whether this call started Ray in-process: then the caller may stop it, and its
    workers with it, with ``ray.shutdown()`` (an interrupted stage does, before it names the
    checkpoint it kept, since until then a worker may still write one).

    Workers import this repository's packages (``common``, ``vitcore``, ``pipelines``, ``training``, ``transfer``), so
    an in-process start puts the repository root on their ``PYTHONPATH``.
    """
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=log_to_driver)
        return False
    _loopback_node()
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    one_node = {k: os.environ.get(k, v) for k, v in ONE_NODE_TRAIN.items()}
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath, **one_node}},
        log_to_driver=log_to_driver,
        configure_logging=True,
        logging_level="WARNING",
    )
    return True


def mute_dropped_exits() -> None:
    """Stop a Ray worker printing a traceback for a SIGTERM that lands in a finalizer.

    When a Tune trial ends, Tune removes its placement group, and the raylet sends SIGTERM to
    the trial's worker if it has not exited yet. Ray's handler raises ``SystemExit`` in the main
    thread at the next bytecode, and when that is a weakref callback or a ``__del__`` (the
    worker is shutting down, collecting its threads) Python cannot raise it there: it drops it
    and prints "Exception ignored in: ... SystemExit: 1", which the driver relays to the console
    after the trial's progress line. The exit was dropped either way (the raylet kills the worker
    200 ms later); this leaves out the traceback and reports every other unraisable error as
    before. Call it in the worker process; it is process-wide and idempotent.
    """
    if getattr(sys.unraisablehook, "_mutes_dropped_exits", False):
        return
    report = sys.unraisablehook

    def hook(unraisable) -> None:
        if unraisable.exc_type is None or not issubclass(unraisable.exc_type, SystemExit):
            report(unraisable)

    hook._mutes_dropped_exits = True
    sys.unraisablehook = hook


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

    With several Ray Train workers, torch's rendezvous store on rank 0 would listen on every
    interface (torch 2.13 has no bind address for it): pre-training passes
    :class:`training.loopback_torch.LoopbackTorchConfig`, which uses a FileStore instead on
    this node.
    """
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def cpus_available() -> int:
    import ray

    return int(ray.cluster_resources().get("CPU", 1))


def copy_final_model(result, output: Path, name: str | None = None) -> Path:
    """Copy the model that a pre-training fit or a Tune trial (``transfer.sweep.report_final``)
    reported with its last checkpoint into ``output``; returns its path there. ``name``: another
    model file of that checkpoint (e.g. :data:`training.best.BEST_MODEL_FILE`)."""
    from vitcore.checkpoint import MODEL_FILE

    name = name or MODEL_FILE
    with result.checkpoint.as_directory() as d, open(Path(d) / name, "rb") as src, \
            atomic_open(output / name) as dst:
        shutil.copyfileobj(src, dst)
    return output / name


class ProgressBoard:
    """A Ray actor that workers post progress rows to and the driver takes them from.

    The driver prints them (:class:`common.progress.ProgressLine`), so progress reaches the
    console of whoever started the job, whether or not Ray forwards worker output
    (``log_to_driver``), with no worker prefix, and once however many ranks there are.
    Rank 0 also counts the worker group's starts on it (starts - 1 restarts): one actor, one
    process, for both. Start it with ``ray.remote(num_cpus=0)(ProgressBoard).remote()``.
    """

    def __init__(self) -> None:
        self._rows: list[dict] = []
        self._starts = 0

    def start(self) -> int:
        self._starts += 1
        return self._starts

    def starts(self) -> int:
        return self._starts

    def post(self, row: dict) -> None:
        self._rows.append(row)

    def take(self) -> list[dict]:
        rows, self._rows = self._rows, []
        return rows


# Ray Train 2.x's record of a run's checkpoints, in the run's folder under the storage path.
SNAPSHOT = "checkpoint_manager_snapshot.json"
_SNAPSHOT_NAME_LISTS = ("validated_checkpoint_dir_names", "timed_out_validation_checkpoint_dir_names",
                        "failed_validation_checkpoint_dir_names")


def _snapshot_dir_names(state: dict) -> list:
    results = list(state.get("checkpoint_results") or []) + list(state.get("pending_training_results") or [])
    if state.get("latest_checkpoint_result"):
        results.append(state["latest_checkpoint_result"])
    names = [r.get("checkpoint_dir_name") if isinstance(r, dict) else r for r in results]
    for key in _SNAPSHOT_NAME_LISTS:
        names += list(state.get(key) or [])
    return names


def _inside_run_dir(name) -> bool:
    """A checkpoint folder name that stays inside the run's folder once joined to it."""
    if not isinstance(name, str) or not name or "\x00" in name or "://" in name or "\\" in name:
        return False
    if name.startswith("/") or name.startswith("~"):
        return False
    parts = name.split("/")
    return ".." not in parts and all(p not in ("", ".") for p in parts)


def _cut_short(text: bytes) -> bool:
    """True for a snapshot Ray began and could not finish: empty, or JSON that ends early."""
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return exc.msg.startswith("Unterminated string") or exc.pos >= len(exc.doc.rstrip())
    except ValueError:
        return False
    return False


def check_resume_snapshot(storage_path: str, run_name: str | None, storage_filesystem=None) -> list[str]:
    """Refuse to resume from a Ray Train snapshot that names a checkpoint folder outside its run.

    Ray Train joins each ``checkpoint_dir_name`` of ``STORAGE/RUN/checkpoint_manager_snapshot.json``
    to the run's folder and reads, and on eviction (``keep_checkpoints``) deletes, the result. A
    crafted snapshot with ``/home/me`` or ``../../data`` in it made a resume delete that folder.
    Every name must be a relative path without ``..``. No run name, or no snapshot: nothing to
    check. ``storage_filesystem`` is the ``pyarrow.fs`` filesystem given to Ray Train, if any.
    Raises ConfigError naming the snapshot and the folder; returns the folder names it lists.
    """
    if not run_name:
        return []
    run_dir = posixpath.join(str(storage_path).rstrip("/"), run_name)
    path = posixpath.join(run_dir, SNAPSHOT)
    try:
        if storage_filesystem is None:
            with open(path, "rb") as f:
                text = f.read()
        else:
            if storage_filesystem.get_file_info(path).type == pyarrow.fs.FileType.NotFound:
                return []
            with storage_filesystem.open_input_stream(path) as f:
                text = f.read()
    except FileNotFoundError:
        return []
    if storage_filesystem is None and _cut_short(text):
        aside = path + ".unreadable"
        os.replace(path, aside)
        print(f"pretrain: warning: run_name {run_name!r}: {path} was cut short (a full disk as it was written, say); moved "
              f"it to {aside}, and the run resumes from its newest checkpoint folder that verifies", file=sys.stderr)
        return []
    try:
        state = json.loads(text)
        names = _snapshot_dir_names(state)
    except (ValueError, AttributeError, TypeError):
        raise ConfigError(f"run_name {run_name!r}: {path} is not a Ray Train snapshot Ray could have written; "
                          "delete it (the run then starts from scratch) or choose another --run-name") from None
    bad = [n for n in names if not _inside_run_dir(n)]
    if bad:
        raise ConfigError(
            f"run_name {run_name!r}: {path} names checkpoint folder {bad[0]!r}, outside the run's folder {run_dir}; "
            "a resume would read it and could delete it. Delete the snapshot (or the run folder) if you did not "
            "write it, or choose another --run-name")
    return names
