"""The one MLflow helper every job uses, and the one place of the project's naming and tagging scheme.

Embedded default: a ``sqlite:///`` store and a local artifact directory under
``./mlruns`` (or ``$VITSCALE_HOME``). Set ``MLFLOW_TRACKING_URI`` to point every
stage at a server instead (``infra/mlflow``). Runs are nested explicitly with
``parent_run_id``; a stray ``MLFLOW_RUN_ID`` in the environment is ignored so
that it cannot silently re-parent a run: ``mlflow.start_run`` resumes the run it names, and every
process a job starts, Ray's workers included, inherits it.

The scheme (:data:`STAGE_EXPERIMENTS`, the ``TAG_*`` names, :func:`run_tags`):

- one experiment per stage, ``vitscale-<stage>`` (prefix: ``$VITSCALE_EXPERIMENT_PREFIX``), so that
  each chart view holds one stage's metrics; child runs (trials, tasks) nest under their stage run
  in the same experiment;
- a parent run in another experiment (the demo's grouping run) is recorded as a tag,
  ``vitscale.parent_run_id`` (and ``vitscale.demo_run_id`` for the demo), not as
  ``mlflow.parentRunId``: MLflow's runs table nests a child only under a parent it lists, so a
  cross-experiment parent link would show nothing more and confuse the run page;
- every top-level run carries the git commit, a hash of its config, the sha256 of the manifest of
  the shard set it read, what de-duplication that data had, and lineage tags
  ``vitscale.lineage.<stage>``: the run ids of the prepare, dedup and pretrain runs whose outputs it
  read, transitively. Each stage writes its run id beside what it writes (the manifest, the
  removals, ``lineage.json`` beside a model), and the next stage reads it from there.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from common.config import ConfigError, not_recipe, recipe_of
from common.fs import SKIP_SHARD_VERIFY_ENV, atomic_write, shard_verify_default
from common.jobenv import RUNTIME_ENV_HINT, inside_copy
from common.text import utf8_text

DEFAULT_PREFIX = "vitscale"
PREFIX_ENV = "VITSCALE_EXPERIMENT_PREFIX"
# Top-level stage -> experiment suffix. Any other stage (a child: finetune-select, vtab-task,
# fewshot-task ...) logs into its parent's experiment.
STAGE_EXPERIMENTS = {
    "prepare": "prepare", "dedup": "dedup", "pretrain": "pretrain", "finetune": "finetune", "vtab": "vtab",
    "fewshot": "fewshot", "report": "report", "demo": "demo", "dedup-calibration": "dedup-calibration",
}
TAG_STAGE = "vitscale.stage"
TAG_GIT_COMMIT = "vitscale.git_commit"
TAG_CONFIG_HASH = "vitscale.config_hash"
# The params that say where and how a run executed (common.config.not_recipe): the report folds them.
TAG_NOT_RECIPE = "vitscale.not_recipe"
TAG_INPUT_MANIFEST = "vitscale.input_manifest_sha256"
#: What the main input holds (``pipelines.schema.content_sha256``): the same for every re-ingest of
#: the same images, so the report ranks such runs together.
TAG_INPUT_DATA = "vitscale.input_data_sha256"
#: The main input manifests a run trained on before it was resumed on other data (--data-changed-ok).
TAG_EARLIER_INPUT = "vitscale.earlier_input_manifest_sha256"
TAG_OUTPUT_MANIFEST = "vitscale.output_manifest_sha256"
TAG_DEDUP_STATE = "vitscale.dedup_state"
TAG_SHARD_VERIFY = "vitscale.shard_verify"  # "sha256", or "skipped (VITSCALE_SKIP_SHARD_VERIFY)"
TAG_LINEAGE = "vitscale.lineage."  # + prepare | dedup | pretrain | finetune
TAG_DEMO_RUN = "vitscale.demo_run_id"
TAG_PARENT_RUN = "vitscale.parent_run_id"
LINEAGE_STAGES = ("prepare", "dedup", "pretrain", "finetune")
# Written beside a model file by the stage that wrote it: its run id and that run's tags.
LINEAGE_FILE = "lineage.json"
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


_READY_STORES: set[str] = set()


def _ensure_sqlite_store(uri: str) -> None:
    """Create and migrate a sqlite store once, under a file lock beside it.

    MLflow migrates an empty store from whichever client opens it first; two jobs starting
    together on a new file both ran the migrations, and the half-migrated store failed every
    later run (``table metrics already exists``).
    """
    if not uri.startswith("sqlite:///") or uri in _READY_STORES:
        return
    import fcntl

    db = Path(uri[len("sqlite:///"):]).expanduser().resolve()
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{db}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            store = SqlAlchemyStore(uri, (db.parent / "artifacts").as_uri())
            store.engine.dispose()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _READY_STORES.add(uri)


def ui_command(uri: str | None = None) -> str:
    """The command that serves the UI on ``uri``. MLflow's GenAI job runner stays off: vitscale
    submits no such jobs, and it would start eight more processes (about 1.1 GB)."""
    uri = uri or tracking_uri()
    return (f"MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false .venv/bin/mlflow ui --backend-store-uri {uri} "
            "--host 127.0.0.1 --port 5000")


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

    _ensure_sqlite_store(uri)
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


def experiment_name(stage: str) -> str:
    """The experiment a top-level stage logs into: ``vitscale-<stage>`` (prefix from ``$VITSCALE_EXPERIMENT_PREFIX``)."""
    prefix = os.environ.get(PREFIX_ENV) or DEFAULT_PREFIX
    return f"{prefix}-{STAGE_EXPERIMENTS.get(stage, stage)}"


def stage_experiments() -> dict[str, str]:
    """Every stage's experiment name, for a reader that wants them all (the demo, the report)."""
    return {stage: experiment_name(stage) for stage in STAGE_EXPERIMENTS}


@contextlib.contextmanager
def start_run(
    stage: str,
    *,
    params: Mapping[str, Any] | None = None,
    experiment: str | None = None,
    parent_run_id: str | None = None,
    run_name: str | None = None,
    tags: Mapping[str, str] | None = None,
    run_id: str | None = None,
    log_system_metrics: bool | None = None,
) -> Iterator[Any]:
    """Open an MLflow run for one stage, log its config as params, and yield the active run.

    The experiment is the stage's own (:func:`experiment_name`); a child stage without one
    (``fewshot-task`` under ``fewshot``, say) goes into its parent's experiment, nested.

    ``run_id`` reopens an existing run instead (a resumed sweep keeps its run and children);
    its params, name and parent were set when it was created.

    ``parent_run_id`` defaults to ``$VITSCALE_PARENT_RUN_ID`` so that a driver such as
    the demo can group stages it does not construct itself. A parent in the same experiment
    nests the run (``mlflow.parentRunId``); a parent in another experiment is recorded as
    :data:`TAG_PARENT_RUN` (and :data:`TAG_DEMO_RUN` when it is a demo run). The run ends
    FAILED if the body raises, so a crashed stage is visible in the UI.
    """
    import mlflow

    os.environ.pop("MLFLOW_RUN_ID", None)
    parent_run_id = parent_run_id or os.environ.get("VITSCALE_PARENT_RUN_ID") or None
    if run_id is not None:
        _use(tracking_uri())
        with mlflow.start_run(run_id=run_id, nested=mlflow.active_run() is not None,
                              log_system_metrics=log_system_metrics) as run:
            yield run
        return
    parent = get_run(parent_run_id) if parent_run_id else None
    if experiment is None and parent is not None and stage not in STAGE_EXPERIMENTS:
        exp_id = parent.info.experiment_id
        _use(tracking_uri())
    else:
        mlflow, exp_id = _setup(experiment or experiment_name(stage))
    extra: dict[str, str] = {}
    nested = parent is not None and parent.info.experiment_id == exp_id
    if parent is not None and not nested:
        extra[TAG_PARENT_RUN] = parent_run_id
        demo = parent_run_id if parent.data.tags.get(TAG_STAGE) == "demo" else parent.data.tags.get(TAG_DEMO_RUN)
        if demo:
            extra[TAG_DEMO_RUN] = demo
    elif parent is not None and parent.data.tags.get(TAG_DEMO_RUN):
        extra[TAG_DEMO_RUN] = parent.data.tags[TAG_DEMO_RUN]
    run_name = utf8_text(run_name or stage)  # a name built from a folder that is not UTF-8 (MLflow's store takes UTF-8 only)
    all_tags = {TAG_STAGE: stage, **extra,
                **{utf8_text(k): utf8_text(str(v)) for k, v in (tags or {}).items()}}
    if not nested and mlflow.active_run() is not None:
        # A driver's run is active (the demo's): MLflow would nest any new run under it, across
        # experiments. Create the run unnested, then make it the active one on top.
        from mlflow.tracking.context import registry

        created = mlflow.MlflowClient(tracking_uri()).create_run(
            exp_id, run_name=run_name, tags=registry.resolve_tags(all_tags))
        ctx = mlflow.start_run(run_id=created.info.run_id, nested=True, log_system_metrics=log_system_metrics)
    else:
        ctx = mlflow.start_run(experiment_id=exp_id, run_name=run_name,
                               parent_run_id=parent_run_id if nested else None, nested=nested, tags=all_tags,
                               log_system_metrics=log_system_metrics)
    with ctx as run:
        if params:
            mlflow.log_params(flatten(params))
        yield run


# -- the tagging scheme ------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    """The commit of the code that runs, or "unknown" outside a git checkout (under ``ray job
    submit`` the working dir is an uploaded copy without ``.git``). A checkout with local
    changes gets ``-dirty``, so that a tag never claims a commit the code does not match. Once
    per process: the code a process runs does not change under it, and the demo tags ~20 runs."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def config_hash(config: Any) -> str:
    """sha256 (first 16 hex digits) of the canonical JSON of what a run computes.

    A stage's config dataclass counts only its recipe fields (``common.config.recipe_of``), so the
    same recipe run into two folders, or on two clusters, has one hash. A plain mapping counts whole.
    """
    values = recipe_of(config) if dataclasses.is_dataclass(config) else dict(config)
    text = json.dumps(values, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def join_ids(*groups: Any) -> str:
    """Run ids from strings (comma-separated allowed) and lists, de-duplicated in order, comma-joined."""
    out: list[str] = []
    for g in groups:
        items = g.split(",") if isinstance(g, str) else (g or [])
        for item in items:
            item = str(item).strip()
            if item and item not in out:
                out.append(item)
    return ",".join(out)


def run_tags(config: Any = None, *, data: list[Mapping[str, Any]] = (),
             main: list[Mapping[str, Any]] | None = None, models: list[Mapping[str, Any]] = ()) -> dict[str, str]:
    """The scheme's tags for a top-level run.

    ``config``: the stage's config dataclass, whose recipe is hashed and whose other fields are
    named in :data:`TAG_NOT_RECIPE`, or a plain mapping, hashed whole. ``data``: the records of
    every shard set the run read (``pipelines.schema.shard_set_record``: ``manifest_sha256``,
    ``prepare_run_id``, ``dedup_run_ids``, ``dedup_state``); ``main``: those that are its main input (default: all), whose manifest sha256 and de-duplication state are
    tagged. ``models``: the lineage records of the models it read (:func:`read_lineage`), whose
    own lineage carries over, so that a fine-tune names its pre-training's prepare and dedup runs.
    """
    main = list(data) if main is None else list(main)
    tags = {TAG_GIT_COMMIT: git_commit()}
    if config is not None:
        tags[TAG_CONFIG_HASH] = config_hash(config)
        if dataclasses.is_dataclass(config):
            tags[TAG_NOT_RECIPE] = ",".join(sorted(not_recipe(config)))
    if data:
        tags[TAG_SHARD_VERIFY] = "sha256" if shard_verify_default() else f"skipped ({SKIP_SHARD_VERIFY_ENV})"
    if main:
        tags[TAG_INPUT_MANIFEST] = join_ids([r["manifest_sha256"] for r in main])
        if all(r.get("content_sha256") for r in main):
            tags[TAG_INPUT_DATA] = join_ids([r["content_sha256"] for r in main])
        states = list(dict.fromkeys(r.get("dedup_state") or "none" for r in main))
        state = "; ".join(states)
        upstream = list(dict.fromkeys(m["tags"].get(TAG_DEDUP_STATE) for m in models
                                      if m.get("tags", {}).get(TAG_DEDUP_STATE)))
        if upstream:
            state += " | pre-training data: " + "; ".join(upstream)
        tags[TAG_DEDUP_STATE] = state
    lineage: dict[str, str] = {}
    for stage in LINEAGE_STAGES:
        ids = [m.get("tags", {}).get(TAG_LINEAGE + stage, "") for m in models]
        ids += [m["run_id"] for m in models if m.get("stage") == stage and m.get("run_id")]
        if stage == "prepare":
            ids += [r.get("prepare_run_id") or "" for r in data]
        if stage == "dedup":
            ids += [join_ids(r.get("dedup_run_ids") or []) for r in data]
        value = join_ids(*ids)
        if value:
            lineage[TAG_LINEAGE + stage] = value
    tags.update(lineage)
    return tags


def set_tags(tags: Mapping[str, str], run_id: str | None = None) -> None:
    """Tags on the active run, or on ``run_id``."""
    import mlflow

    clean = {utf8_text(k): utf8_text(str(v))[:5000] for k, v in tags.items()}
    if run_id is None:
        mlflow.set_tags(clean)
    else:
        client = mlflow.MlflowClient(tracking_uri())
        for k, v in clean.items():
            client.set_tag(run_id, k, v)


def write_lineage(directory: str | Path, run: Any, stage: str) -> Path:
    """Record beside a model what produced it: the run id, its stage and its scheme tags.

    Every stage that reads the model reads this file (:func:`read_lineage`) for its lineage tags.
    """
    tags = {k: v for k, v in get_run(run.info.run_id).data.tags.items() if k.startswith("vitscale.")}
    record = {"run_id": run.info.run_id, "stage": stage, "experiment_id": run.info.experiment_id,
              "tracking_uri": tracking_uri(), "tags": tags}
    path = Path(directory) / LINEAGE_FILE
    atomic_write(path, json.dumps(record, indent=2, sort_keys=True))
    return path


def read_lineage(model_path: str | Path) -> dict[str, Any]:
    """The :func:`write_lineage` record beside ``model_path`` (a model file or its folder); {} when absent."""
    path = Path(model_path)
    path = (path if path.is_dir() else path.parent) / LINEAGE_FILE
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) and "run_id" in record else {}


def log_shard_inputs(records: list[Mapping[str, Any]], *, context: str = "training",
                     run_id: str | None = None) -> None:
    """Log each shard set a run read as an MLflow dataset input: named after the shard set,
    digest = its manifest's sha256, source = its URL.

    The store keeps at most 36 characters of a digest, so the digest is the sha256's first 36
    hex digits; the full sha256 is in the dataset's profile and in :data:`TAG_INPUT_MANIFEST`.
    """
    import mlflow
    from mlflow.entities import Dataset, DatasetInput, InputTag

    datasets = []
    for r in records:
        url = str(r["url"])
        scheme = url.split("://", 1)[0] if "://" in url else "local"
        entity = Dataset(
            name=str(r["name"]), digest=str(r["manifest_sha256"])[:36],
            source_type="local" if scheme == "file" else scheme, source=json.dumps({"uri": url}),
            profile=json.dumps({"manifest_sha256": r["manifest_sha256"], "num_rows": r.get("num_rows"),
                                "dedup_state": r.get("dedup_state"), "prepare_run_id": r.get("prepare_run_id")}),
        )
        role = r.get("role") or context
        datasets.append(DatasetInput(entity, tags=[InputTag("mlflow.data.context", role)]))
    if not datasets:
        return
    run_id = run_id or mlflow.active_run().info.run_id
    mlflow.MlflowClient(tracking_uri()).log_inputs(run_id, datasets=datasets)


def refresh_inputs(run_id: str, tags: Mapping[str, str], records: list[Mapping[str, Any]]) -> bool:
    """A reopened run that resumes on other data (``--data-changed-ok``): its scheme tags made those
    of the data it goes on with (``tags``, :func:`run_tags`), the manifest it trained on until now
    kept in :data:`TAG_EARLIER_INPUT`, and ``records`` logged as further inputs. False, and nothing
    written, when its main input is the one it started on."""
    before = get_run(run_id).data.tags
    if before.get(TAG_INPUT_MANIFEST) == tags.get(TAG_INPUT_MANIFEST):
        return False
    earlier = join_ids(before.get(TAG_EARLIER_INPUT, ""), before.get(TAG_INPUT_MANIFEST, ""))
    set_tags({**tags, **({TAG_EARLIER_INPUT: earlier} if earlier else {})}, run_id)
    log_shard_inputs(records, run_id=run_id)
    return True


def metric_history(run_id: str, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each logged metric among ``keys``, in step order."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri())
    out = {}
    for key in keys:
        points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        if points:
            out[key] = points
    return out


def log_model_from_code(code: str | Path, *, weights: str | Path, name: str = "model",
                        code_paths: list[str] | None = None, pip_requirements: list[str] | None = None,
                        metadata: Mapping[str, Any] | None = None, input_example: Any = None,
                        signature: Any = None, model_config: Mapping[str, Any] | None = None) -> Any:
    """Log an MLflow pyfunc model from code (no pickle): ``code`` is the model's Python file,
    ``weights`` its weights, shipped as the artifact ``weights``; ``model_config`` reaches the
    model's ``load_context`` as ``context.model_config``. Returns MLflow's ModelInfo.

    ``pip_requirements`` are given so that MLflow does not load the model to infer them.
    """
    import warnings

    import mlflow

    with warnings.catch_warnings():  # the signature is given; an example would load the model once more
        warnings.filterwarnings("ignore", message=".*An input example was not provided")
        return mlflow.pyfunc.log_model(
            name=name, python_model=str(code), artifacts={"weights": str(weights)}, code_paths=code_paths,
            pip_requirements=pip_requirements, metadata=dict(metadata or {}), input_example=input_example,
            signature=signature, model_config=dict(model_config or {}),
        )


def log_metrics_to(run_id: str, metrics: Mapping[str, float], *, step: int = 0, uri: str | None = None) -> None:
    """Log to a run by id without making it active: for Ray workers (rank 0) writing into
    a run the driver owns. Ray Train V2 rejects MLflowLoggerCallback, so this is the path."""
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
        tags={"mlflow.parentRunId": parent_run_id, TAG_STAGE: stage,
              **({TAG_DEMO_RUN: parent.data.tags[TAG_DEMO_RUN]} if TAG_DEMO_RUN in parent.data.tags else {})},
    )
    if params:
        client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in flatten(params).items()])
    return run.info.run_id


def end_run(run_id: str, *, failed: bool = False, uri: str | None = None, status: str | None = None) -> None:
    """End ``run_id`` FINISHED, FAILED (``failed``), or with ``status`` (``KILLED`` for a run whose process is gone)."""
    import mlflow

    mlflow.MlflowClient(uri or tracking_uri()).set_terminated(run_id, status or ("FAILED" if failed else "FINISHED"))


def end_active_run(status: str) -> None:
    """End the active run with ``status`` (``KILLED`` for an interrupted stage) before its
    ``start_run`` block ends it as FAILED."""
    import mlflow

    mlflow.end_run(status)


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


def register_model(name: str, model_uri: str, *, tags: Mapping[str, str] | None = None) -> dict[str, str]:
    """Register the logged MLflow model ``model_uri`` as a new version of ``name`` in the model
    registry, with ``tags`` on the version; returns its name and version."""
    import mlflow

    _use(tracking_uri())
    version = mlflow.register_model(model_uri, name,
                                    tags={utf8_text(k): utf8_text(str(v)) for k, v in (tags or {}).items()})
    return {"name": name, "version": str(version.version)}
