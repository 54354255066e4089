"""Ray Tune sweeps that resume, and their state, shared by fine-tuning and VTAB.

A sweep lives under ``OUTPUT/ray/<name>``; running the same command again after an interruption
restores it (finished trials are kept, unfinished and errored ones run again); so does one stopped
by SIGINT or SIGTERM, which ends in one line (:class:`common.cli.Interrupted`). Its MLflow run is
named in ``OUTPUT/<stage>_sweep_state.json`` with the configuration it ran, so the re-run reopens the same
MLflow run, and a re-run with different flags is refused rather than mixing two sweeps' trials.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from common import progress, tracking
from common.cli import Interrupted, interrupts
from common.config import ConfigError, changed_fields
from common.fs import atomic_open, atomic_write
from common.locks import check_same_data
from transfer import tune_state

LEGACY_STATE_FILE = "sweep_state.json"  # both stages' state, before it was per stage


def trial_resources(cpus_per_trial: int, gpus_per_trial: float) -> dict:
    return {"cpu": cpus_per_trial, **({"gpu": gpus_per_trial} if gpus_per_trial else {})}


def tune_sweep(trainable, param_space: dict, *, name: str, output: Path, resources: dict, metric: str,
               max_concurrent: int = 0, max_failures: int = 0, label: tuple[str, ...] = ("lr",),
               prog: str = "finetune", reuse_actors: bool = True):
    """Run a Tune sweep under ``output/ray/name``, or resume it if an interrupted one is there.

    A resumed sweep keeps its finished trials and runs the unfinished and errored ones again
    (``resume_errored``: they start from scratch, as a retry does). The console gets a line per
    trial event, trials named by the config keys in ``label`` (:class:`common.progress.TrialLines`).

    ``reuse_actors``: a trial runs in the process of a finished one where one is free. A small
    trial spends most of its time starting a Ray worker and importing torch and MLflow; each trial
    seeds itself (:func:`transfer.sgd.start_trial`), so its results do not depend on the process.
    """
    from ray import tune

    from common.progress import TrialLines  # builds a ray.tune.Callback: loads Ray

    storage, files = output / "ray", tune_state.storage()
    trainable = tune.with_resources(trainable, resources)
    folder = storage / name
    if tune.Tuner.can_restore(str(folder), storage_filesystem=files) and tune_state.prepare_resume(folder, prog):
        # param_space again: were the grid's state lost after all, Tune would otherwise start
        # an experiment of one trial with an empty config.
        tuner = tune.Tuner.restore(str(folder), trainable=trainable, param_space=param_space,
                                   resume_errored=True, storage_filesystem=files)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=param_space,
            tune_config=tune.TuneConfig(metric=metric, mode="max", max_concurrent_trials=max_concurrent or None,
                                        reuse_actors=reuse_actors),
            run_config=tune.RunConfig(name=name, storage_path=str(storage), storage_filesystem=files, verbose=0,
                                      callbacks=[TrialLines(f"{prog} {name}", label, metric)],
                                      failure_config=tune.FailureConfig(max_failures=max_failures)),
        )
    # Tune's current output engine prints its experiment box and a TensorBoard hint to stdout
    # even at verbose=0; the older one, which Tune reads this variable for, honours verbose=0.
    # Tune's own SIGINT handler stops the sweep and returns half a result grid, then prints a
    # Tuner.restore hint; Ctrl-C ends the stage instead (sweep_run says what was kept).
    # The sweep's state is saved after every event (a value the caller set stands), not every 10 s
    # or more: a sweep killed just after a trial finished must not run that trial again on resume.
    # The state is a few kB per trial. Tune reads it when fit starts its controller.
    with _env("RAY_AIR_NEW_OUTPUT", None if progress.verbose() else "0"), \
            _env("TUNE_DISABLE_SIGINT_HANDLER", "1"), \
            _env("TUNE_GLOBAL_CHECKPOINT_S", os.environ.get("TUNE_GLOBAL_CHECKPOINT_S", "0")), interrupts():
        return tuner.fit()


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """``os.environ[name] = value`` for the duration (None: leave it as it is)."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before


def report_final(metrics: dict, model, label_names: list[str] | None = None) -> None:
    """Report a trial's last result to Tune with its model as the checkpoint; the model file's
    metadata names its classes, in head order, beside the config. The checkpoint's record holds
    the file's sha256 (:func:`copy_trial_model` checks it)."""
    from ray import tune

    import vitcore
    from training.checkpointer import write_record
    from vitcore.checkpoint import MODEL_FILE, label_metadata

    with tempfile.TemporaryDirectory() as d:
        vitcore.save_checkpoint(model, Path(d) / MODEL_FILE, extra_metadata=label_metadata(label_names))
        write_record(Path(d), [MODEL_FILE], int(metrics.get("step", 0)))
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))


def verified_checkpoint(trial_dir: Path, prog: str) -> Path | None:
    """The newest checkpoint folder of a finished trial whose files have the sizes and sha256 its
    ``checkpoint.json`` records; None when its checkpoints predate records.

    A newer folder that does not match is named in one line, and the next one is used; when none
    matches, the stage is refused in one line naming them and the fix.
    """
    from training.checkpointer import RECORD, corrupt_file, read_record

    bad = []
    for folder in sorted((p for p in trial_dir.glob("checkpoint_*") if (p / RECORD).is_file()), reverse=True):
        record = read_record(folder)
        if record is not None and corrupt_file(folder, record) is None:
            if bad:
                print(f"{prog}: warning: checkpoint: {', '.join(map(str, bad))} does not match the sha256 its "
                      f"checkpoint.json records; using {folder} instead (remove the bad folder once you have "
                      "looked at it)", file=progress.console()[0], flush=True)
            return folder
        bad.append(folder)
    if bad:
        raise ConfigError(f"checkpoint: no checkpoint of {prog} trial {trial_dir.name} matches the sizes and sha256 "
                          f"its checkpoint.json records ({', '.join(map(str, bad))}); remove {trial_dir.parent} "
                          "and re-run the same command to run that sweep's trials again")
    return None


def copy_trial_model(result, output: Path, prog: str) -> Path:
    """Copy the model of a finished trial (:func:`report_final`) into ``output`` from its newest
    checkpoint that matches its record (:func:`verified_checkpoint`); returns its path there."""
    from training.ray_utils import copy_final_model
    from vitcore.checkpoint import MODEL_FILE

    folder = verified_checkpoint(Path(result.path), prog)
    if folder is None:  # a trial that finished before checkpoints carried records
        return copy_final_model(result, output)
    with open(folder / MODEL_FILE, "rb") as src, atomic_open(output / MODEL_FILE) as dst:
        shutil.copyfileobj(src, dst)
    return output / MODEL_FILE


# Tuner.restore reloads these from the sweep's own record, so a resume cannot change them.
RESTORED_KEYS = ("max_concurrent", "max_failures")


def state_file(stage: str) -> str:
    """The sweep state's file name: one per stage, so that no stage reads or replaces another's."""
    return f"{stage}_sweep_state.json"


def _state_path(output: Path, stage: str) -> Path | None:
    """The stage's state file in ``output``; a folder from before the names were per stage holds
    ``sweep_state.json``, read when its config is of this stage (fine-tuning's names ``train``)."""
    path = output / state_file(stage)
    if path.is_file():
        return path
    legacy = output / LEGACY_STATE_FILE
    try:
        config = json.loads(legacy.read_text()).get("config", {})
    except (OSError, ValueError, AttributeError):
        return None
    return legacy if isinstance(config, dict) and ("train" in config) == (stage == "finetune") else None


def open_sweep_state(output: Path, config: Mapping[str, Any], *, stage: str, fresh_keys: Iterable[str] = (),
                     data: Mapping[str, dict] | None = None, data_changed_ok: bool = False) -> dict | None:
    """The state of an interrupted ``stage`` sweep in ``output`` (its MLflow run), or None for a new one.

    Resuming with a different configuration, or on shard sets (``data``, :func:`manifest_digests`)
    replaced since the sweep started, would mix trials of two sweeps; that is refused.
    """
    path = _state_path(output, stage)
    if path is None:
        return None
    state = json.loads(path.read_text())
    old = state.get("config", {})
    # Compared as saved: JSON has lists, not tuples, and strings for what it cannot hold.
    now = json.loads(json.dumps(dict(config), default=str))
    changed = changed_fields(old, now, set(fresh_keys) - set(RESTORED_KEYS))
    if changed:
        diffs = ", ".join(f"{k}: sweep {old.get(k)!r}, now {now.get(k)!r}" for k in changed)
        raise ConfigError(f"output: {output} holds a {stage} sweep run with other flags ({diffs}); re-run with "
                          "the same flags to resume it, or pass a new --output")
    check_same_data(state.get("data"), dict(data or {}), stage=stage, what=f"{stage} sweep",
                    fix="pass a new --output to sweep it afresh", changed_ok=data_changed_ok)
    return state


def manifest_digests(records: Mapping[str, dict]) -> dict[str, dict]:
    """The sha256 of each shard set's manifest, by name, from its record (``shard_set_record``)."""
    return {name: {"url": r["url"], "manifest_sha256": r["manifest_sha256"]} for name, r in records.items()}


def save_sweep_state(output: Path, config: Mapping[str, Any], run_id: str, *, stage: str,
                     data: Mapping[str, dict] | None = None) -> None:
    state = {"config": dict(config), "mlflow_run_id": run_id, **({"data": dict(data)} if data else {})}
    atomic_write(str(output / state_file(stage)), json.dumps(state, indent=2, default=str))


def close_interrupted_children(run_id: str) -> int:
    """Mark the child runs an interrupted sweep left RUNNING as KILLED (their trials run again)."""
    import mlflow

    client = mlflow.MlflowClient(tracking.tracking_uri())
    parent = client.get_run(run_id)
    stale = client.search_runs([parent.info.experiment_id],
                               filter_string=f"tags.mlflow.parentRunId = '{run_id}' and attributes.status = 'RUNNING'")
    for r in stale:
        client.set_terminated(r.info.run_id, "KILLED")
    return len(stale)


@contextlib.contextmanager
def sweep_run(stage: str, output: Path, config: Mapping[str, Any], state: dict | None, *,
              records: list[dict], new: Mapping[str, Any], data: Mapping[str, dict] | None = None,
              **options) -> Iterator:
    """The sweep's MLflow run: the interrupted sweep's run reopened when ``state`` names one, else
    a new run started with ``new`` (and its shard-set inputs logged). ``options`` go to both;
    ``data`` (:func:`manifest_digests`) is recorded in the state, for a resume to check."""
    if state:
        ctx = tracking.start_run(stage, run_id=state["mlflow_run_id"], **options)
    else:
        ctx = tracking.start_run(stage, **new, **options)
    with ctx as run:
        if state:
            close_interrupted_children(run.info.run_id)
            tracking.refresh_inputs(run.info.run_id, new.get("tags", {}), records)
        else:
            tracking.log_shard_inputs(records)
        save_sweep_state(output, config, run.info.run_id, stage=stage, data=data)
        try:
            yield run
        except KeyboardInterrupt as exc:
            tracking.end_active_run("KILLED")
            raise Interrupted(getattr(exc, "signum", signal.SIGINT),
                              f"the trials that finished are kept in {output / 'ray'}") from None
