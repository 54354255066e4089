"""The one MLflow helper every job uses.

Embedded default: a ``sqlite:///`` store and a local artifact directory under
``./mlruns`` (or ``$VITSCALE_HOME``). Set ``MLFLOW_TRACKING_URI`` to point every
stage at a server instead (``infra/mlflow``). Runs are nested explicitly with
``parent_run_id``; a stray ``MLFLOW_RUN_ID`` in the environment is ignored so
that it cannot silently re-parent a run (REFERENCE.md, Ray pitfalls).
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

from common.config import ConfigError
from common.jobenv import RUNTIME_ENV_HINT, inside_copy
from common.text import utf8_text

DEFAULT_EXPERIMENT = "vitscale"
# MLflow 3.17's UI opens an experiment without this tag on its GenAI overview (traces,
# latency), not on the runs; every vitscale experiment is model training.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def home() -> Path:
    value = os.environ.get("VITSCALE_HOME", "mlruns")
    if inside_copy(value):
        raise ConfigError(
            f"VITSCALE_HOME: the MLflow store {value if 'VITSCALE_HOME' in os.environ else './mlruns (the default)'} "
            f"would land in Ray's uploaded copy of the working dir, "
            f"which is deleted with the Ray session; {RUNTIME_ENV_HINT}"
        )
    return Path(value).expanduser().resolve()


def default_tracking_uri() -> str:
    return f"sqlite:///{home() / 'mlflow.db'}"


def _local_store_path(uri: str) -> str | None:
    """The file or folder a local tracking URI writes to (``sqlite:///x`` is relative, ``sqlite:////x`` absolute)."""
    for prefix in ("sqlite:///", "file://", "file:"):
        if uri.startswith(prefix):
            return uri[len(prefix):] or "."
    return None if "://" in uri else uri


def tracking_uri() -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return default_tracking_uri()
    local = _local_store_path(uri)
    if local is not None and inside_copy(local):
        raise ConfigError(
            f"MLFLOW_TRACKING_URI: {uri!r} would write into Ray's uploaded copy of the working dir, which is "
            f"deleted with the Ray session; {RUNTIME_ENV_HINT}"
        )
    return uri


def ui_command(uri: str | None = None) -> str:
    uri = uri or tracking_uri()
    return f".venv/bin/mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000"


def ui_url(experiment_id: str, base: str = "http://127.0.0.1:5000") -> str:
    """The UI's page for an experiment, on its runs table.

    MLflow 3.17's UI takes the experiment's kind from its GenAI / Model training switch (the
    ``workflowType`` query parameter, else the browser's last choice, GenAI at first), not
    from the ``mlflow.experimentKind`` tag: a bare experiment link opens on the empty GenAI
    overview for a new user.
    """
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}?workflowType=machine_learning"


def _use(uri: str) -> None:
    """``mlflow.set_tracking_uri(uri)`` without its side effect on ``os.environ``.

    MLflow also exports the URI as ``MLFLOW_TRACKING_URI``; :func:`tracking_uri` would then
    read its own echo and ignore a later change of ``VITSCALE_HOME`` in the same process.
    Workers get the URI passed explicitly, so nothing relies on the export.
    """
    import mlflow

    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


def _setup(experiment: str):
    import mlflow

    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    _use(uri)
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        artifact_location = None
        if uri.startswith("sqlite:///"):
            # Beside the database: a store named only by MLFLOW_TRACKING_URI stays one folder,
            # and never falls back to ./mlruns (under `ray job submit`, Ray's throwaway copy).
            art = Path(uri[len("sqlite:///"):]).expanduser().resolve().parent / "artifacts"
            art.mkdir(parents=True, exist_ok=True)
            artifact_location = art.as_uri()
        try:
            return mlflow, client.create_experiment(
                experiment, artifact_location=artifact_location, tags=dict([EXPERIMENT_KIND]))
        except Exception:  # another process created it first
            exp = client.get_experiment_by_name(experiment)
    key, kind = EXPERIMENT_KIND
    if key not in exp.tags:
        # An experiment created before the tag existed, or by another tool; a kind someone
        # chose on purpose is left alone.
        client.set_experiment_tag(exp.experiment_id, key, kind)
    return mlflow, exp.experiment_id


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            text = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
            out[utf8_text(name)] = utf8_text(text)[:6000]  # MLflow caps param values; its store takes UTF-8 only
    return out


@contextlib.contextmanager
def start_run(
    stage: str,
    *,
    params: Mapping[str, Any] | None = None,
    experiment: str = DEFAULT_EXPERIMENT,
    parent_run_id: str | None = None,
    run_name: str | None = None,
    tags: Mapping[str, str] | None = None,
    run_id: str | None = None,
) -> Iterator[Any]:
    """Open an MLflow run for one stage, log its config as params, and yield the active run.

    ``run_id`` reopens an existing run instead (a resumed sweep keeps its run and children);
    its params, name and parent were set when it was created.

    ``parent_run_id`` defaults to ``$VITSCALE_PARENT_RUN_ID`` so that a driver such as
    the demo can nest stages it does not construct itself. The run ends FAILED if the
    body raises, so a crashed stage is visible in the UI.
    """
    os.environ.pop("MLFLOW_RUN_ID", None)
    parent_run_id = parent_run_id or os.environ.get("VITSCALE_PARENT_RUN_ID") or None
    mlflow, exp_id = _setup(experiment)
    if run_id is not None:
        with mlflow.start_run(run_id=run_id) as run:
            yield run
        return
    all_tags = {"vitscale.stage": stage, **{utf8_text(k): utf8_text(str(v)) for k, v in (tags or {}).items()}}
    with mlflow.start_run(
        experiment_id=exp_id,
        run_name=run_name or stage,
        parent_run_id=parent_run_id,
        nested=parent_run_id is not None,
        tags=all_tags,
    ) as run:
        if params:
            mlflow.log_params(flatten(params))
        yield run


def log_metrics_to(run_id: str, metrics: Mapping[str, float], *, step: int = 0, uri: str | None = None) -> None:
    """Log to a run by id without making it active: for Ray workers (rank 0) writing into
    a run the driver owns. Ray Train V2 rejects MLflowLoggerCallback, so this is the path."""
    import time

    import mlflow
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client = mlflow.MlflowClient(uri or tracking_uri())
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])


def create_child_run(parent_run_id: str, name: str, *, params: Mapping[str, Any] | None = None,
                     stage: str, uri: str | None = None) -> str:
    """Create a run nested under ``parent_run_id`` from any process (a Tune trial, say)
    without touching the process's active run; returns its id."""
    import mlflow
    from mlflow.entities import Param

    client = mlflow.MlflowClient(uri or tracking_uri())
    parent = client.get_run(parent_run_id)
    run = client.create_run(
        parent.info.experiment_id,
        run_name=name,
        tags={"mlflow.parentRunId": parent_run_id, "vitscale.stage": stage},
    )
    if params:
        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in flatten(params).items()])
    return run.info.run_id


def end_run(run_id: str, *, failed: bool = False, uri: str | None = None) -> None:
    import mlflow

    mlflow.MlflowClient(uri or tracking_uri()).set_terminated(run_id, "FAILED" if failed else "FINISHED")


def log_metrics(metrics: Mapping[str, float], step: int | None = None) -> None:
    import mlflow

    mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)


def log_dict(data: Any, artifact_file: str) -> None:
    import mlflow

    mlflow.log_dict(data, artifact_file)


def log_artifact(path: str | Path, artifact_path: str | None = None) -> None:
    import mlflow

    mlflow.log_artifact(str(path), artifact_path=artifact_path)


def log_text(text: str, artifact_file: str) -> None:
    import mlflow

    mlflow.log_text(text, artifact_file)


def get_run(run_id: str):
    import mlflow

    _use(tracking_uri())
    return mlflow.MlflowClient(tracking_uri()).get_run(run_id)


def scratch_dir(prefix: str = "vitscale-") -> str:
    return tempfile.mkdtemp(prefix=prefix)


def register_model(name: str, source: str, run_id: str, *, tags: Mapping[str, str] | None = None,
                   uri: str | None = None) -> dict[str, str]:
    """Register ``source`` (a run's artifact folder) as a new version of model ``name`` in the
    MLflow model registry, with ``tags`` on the version; returns its name and version."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient(uri or tracking_uri())
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
            raise
    version = client.create_model_version(name, source, run_id=run_id,
                                          tags={utf8_text(k): utf8_text(str(v)) for k, v in (tags or {}).items()})
    return {"name": name, "version": str(version.version)}
