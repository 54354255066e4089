"""A study's unfinished cells as the trials of one Ray Tune experiment, so that a cluster runs them
side by side: each trial drives one cell's Ray Train run (:func:`training.pretrain.run_pretrain`)
on the workers it gets, and ``at_once`` bounds the cells running together.

A trial reserves no CPU: the Train workers it launches reserve theirs, so cells that fill the
cluster's CPUs between them all start. With one cell at a time (``--cells-at-once 1``, or a
cluster that holds one cell) the cells run in the study's own process, one after another. Tune's experiment is not resumed: a launch runs a fresh one
over the cells without a summary, each resuming from its own checkpoint as a pre-training
submitted again does. Its files go under ``OUTPUT/tune`` and are removed when it ends.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from ray import tune

from common import tracking
from common.cli import Interrupted, interrupts
from common.progress import duration
from training.pretrain import SUMMARY, PretrainConfig, read_run_record, run_pretrain

TUNE_DIR = "tune"
# Tune needs a resource in a trial's bundle; one byte of memory holds back nothing a cell needs.
TRIAL_RESOURCES = {"cpu": 0, "memory": 1}


def cell_progress(label: str) -> str:
    """What a cell's step lines begin with: ``pretrain, cell 2/4 Ti/8 at fraction 1``."""
    return f"pretrain, cell {label}"


def cell_trial(config: dict) -> dict:
    """One cell: its pre-training run, logged to the study's store (the trial's process has its
    own environment) and nested under the study's run."""
    from training.ray_utils import mute_dropped_exits

    mute_dropped_exits()
    os.environ["MLFLOW_TRACKING_URI"] = config["mlflow_uri"]
    if os.path.isdir(config["cwd"]):  # Tune starts a trial in its own folder; the cell's paths are the driver's
        os.chdir(config["cwd"])
    index = str(config["index"])
    summary = run_pretrain(PretrainConfig(**config["cells"][index]), progress=cell_progress(config["labels"][index]))
    return {"steps": summary["steps"]}


class CellLines(tune.Callback):
    """The driver's line when a cell's trial starts and when it ends; keeps the running trials, so
    that an interrupted study can stop them."""

    def __init__(self, labels: dict[int, str]) -> None:
        self.labels, self.started, self.running = labels, {}, {}

    def _say(self, trial, text: str) -> None:
        print(f"study: cell {self.labels[trial.config['index']]}: {text}", file=sys.stderr, flush=True)

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self.started[trial.trial_id], self.running[trial.trial_id] = time.monotonic(), trial
        self._say(trial, "pre-training")

    def _ended(self, trial) -> str:
        self.running.pop(trial.trial_id, None)
        return duration(time.monotonic() - self.started.get(trial.trial_id, time.monotonic()))

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._say(trial, f"pre-trained in {self._ended(trial)}")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._say(trial, f"failed after {self._ended(trial)}")

    def stop_running(self) -> None:
        """End the running trials' processes, and with them the Train runs they own."""
        import ray

        for trial in list(self.running.values()):
            actor = getattr(trial.temporary_state, "ray_actor", None)
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor)


def at_once(requested: int, cells: list[PretrainConfig]) -> int:
    """``requested``, or for 0 as many cells as the cluster's CPUs (and GPUs) hold, at least 1."""
    import ray

    if requested:
        return requested
    held = ray.cluster_resources()
    fits = min(int(held.get("CPU", 0) // (c.num_workers * c.cpus_per_worker)) for c in cells)
    if any(c.use_gpu for c in cells):
        fits = min(fits, min(int(held.get("GPU", 0) // c.num_workers) for c in cells))
    return max(1, fits)


def run_cells(cells: dict[int, PretrainConfig], labels: dict[int, str], parent_run_id: str, output: Path,
              cells_at_once: int) -> None:
    """Pre-train ``cells`` (by their index in the grid) as Tune trials; returns when all are
    finished, or raises the first failed cell's own error (Ray's and Tune's wrappers removed).

    One cell at a time runs in this process instead: a trial would add nothing but its own
    process (its imports, and Ray's lower worker priority on a busy machine) to every cell.
    """
    n = at_once(cells_at_once, list(cells.values()))
    if n == 1:
        for i in sorted(cells):
            print(f"study: cell {labels[i]}: pre-training", file=sys.stderr, flush=True)
            start = time.monotonic()
            run_pretrain(dataclasses.replace(cells[i], parent_run_id=parent_run_id), progress=cell_progress(labels[i]))
            print(f"study: cell {labels[i]}: pre-trained in {duration(time.monotonic() - start)}", file=sys.stderr)
        return
    storage = output / TUNE_DIR
    shutil.rmtree(storage, ignore_errors=True)  # a killed launch's: this launch starts its own
    space = {"index": tune.grid_search(sorted(cells)), "mlflow_uri": tracking.tracking_uri(), "cwd": os.getcwd(),
             "labels": {str(i): labels[i] for i in cells},
             "cells": {str(i): dataclasses.asdict(dataclasses.replace(c, parent_run_id=parent_run_id))
                       for i, c in cells.items()}}
    lines = CellLines(labels)
    tuner = tune.Tuner(
        tune.with_resources(cell_trial, TRIAL_RESOURCES), param_space=space,
        tune_config=tune.TuneConfig(max_concurrent_trials=n,
                                    reuse_actors=True),
        run_config=tune.RunConfig(name="cells", storage_path=str(storage), verbose=0, callbacks=[lines],
                                  failure_config=tune.FailureConfig(max_failures=0, fail_fast=True)))
    try:
        with _quiet_tune(), interrupts():
            results = tuner.fit()
    except KeyboardInterrupt as exc:
        lines.stop_running()
        _close_unfinished(cells.values())
        tracking.end_active_run("KILLED")
        raise Interrupted(getattr(exc, "signum", signal.SIGINT),
                          f"the finished cells are kept in {output / 'cells'}, and each unfinished one resumes "
                          "from its own checkpoint") from None
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    failed = [r.error for r in results if r.error is not None]
    if failed:  # the first cell that failed stopped the others (fail_fast)
        _close_unfinished(cells.values())
        raise own_error(failed[0]) from None
    missing = [labels[i] for i, c in cells.items() if not (Path(c.output) / SUMMARY).is_file()]
    if missing:
        raise RuntimeError(f"study: Tune ended without an error, but cell {', '.join(missing)} wrote no summary")


def own_error(exc: BaseException) -> BaseException:
    """The exception a trial raised, out of Tune's and Ray's wrappers (``TuneError``, ``RayTaskError``)."""
    from ray.exceptions import RayTaskError
    from ray.tune.error import TuneError

    seen: BaseException = exc
    while isinstance(seen, (TuneError, RayTaskError)):
        inner = getattr(seen, "cause", None) or seen.__cause__
        if inner is None:
            break
        seen = inner
    return seen


def _close_unfinished(cells) -> None:
    """Mark the MLflow run of each cell that a stopped trial left RUNNING as KILLED (it resumes into it)."""
    from mlflow.exceptions import MlflowException

    for cell in cells:
        run_id = read_run_record(Path(cell.output)).get("mlflow_run_id")
        with contextlib.suppress(MlflowException):
            if run_id and tracking.get_run(run_id).info.status == "RUNNING":
                tracking.end_run(run_id, status="KILLED")


@contextlib.contextmanager
def _quiet_tune() -> Iterator[None]:
    """Tune's older output engine, which honours ``verbose=0`` (the current one prints its
    experiment box and a TensorBoard hint), and without ``--verbose`` none of Tune's log records
    (a failed cell's traceback, "Trials did not complete"): the study says it in one line. Ctrl-C
    ends the study, not Tune's own handler (which stops the experiment and returns half a result)."""
    from common import progress

    values: dict[str, Any] = {"TUNE_DISABLE_SIGINT_HANDLER": "1"}
    tune_log, level = logging.getLogger("ray.tune"), logging.getLogger("ray.tune").level
    if not progress.verbose():
        values["RAY_AIR_NEW_OUTPUT"] = "0"
        tune_log.setLevel(logging.CRITICAL)
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        tune_log.setLevel(level)
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
