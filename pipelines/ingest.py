"""The ``prepare`` driver: plan the inputs, run the Beam pipeline, check the accounting, publish the set.

The parts, each in its module:

- the Beam graph, stage by stage: :mod:`pipelines.graph`;
- the runner and the engine behind it (DirectRunner, Dask, others): :mod:`pipelines.runners`;
- the shard writer and its digest: :mod:`pipelines.shard_writer`;
- the plan files and an attempt's staging folder: :mod:`pipelines.staging`;
- the reconciliation into a manifest, and the run's metrics: :mod:`pipelines.accounting`;
- the output folder's lock and the swap that publishes a set: :mod:`pipelines.output`.

Counts are reconciled from the pipeline's outputs against an independent count of the items
read; the job refuses to write a manifest when ``inputs != written + rejected + duplicates``,
after running the pipeline once more. Output is atomic at two levels: each shard is written
under a temporary name then renamed, and ``manifest.json`` (written last) is what makes a shard
set visible to :class:`pipelines.schema.ShardSet`; a set already there stays readable until the
new one replaces it. The same inputs give byte-identical shards.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import signal
import sys
import time
from typing import Any, Mapping

import fsspec

from common import config as vconfig
from common import tracking
from common.cli import Interrupted, interrupts
from common.config import InputError
from common.fs import is_local, url_to_fs
from common.jobenv import durable_path
from common.progress import TTY_EVERY, IngestProgress, ProgressLine, Ticker
from pipelines import direct_runner, runners, schema, space, staging, worker_counts
from pipelines.accounting import (
    MAX_ATTEMPTS,
    AccountingError,
    dominant_rejection,
    nothing_written,
    run_metrics,
    summarise,
)
from pipelines.config import PrepareConfig, PrepareError
from pipelines.graph import build_pipeline
from pipelines.labels import renumbered
from pipelines.output import OutputFolder
from pipelines.sources import SourceError, Unit, detect_format, hf_parquet, plan, webdataset
from pipelines.sources.labels import label_files

log = logging.getLogger(__name__)



def load_label_map(path: str) -> dict[str, int]:
    """A label map file: JSON ``{"name": id}``, a JSON list of names, or a text file of one name per line."""
    try:
        with fsspec.open(path, "rt") as f:
            text = f.read()
    except FileNotFoundError:
        raise PrepareError(f"label_map: {path} not found; pass a JSON {{name: id}} file or a names list") from None
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PrepareError(f"label_map: {path} is not valid JSON ({exc})") from None
    else:
        data = [line.strip() for line in text.splitlines() if line.strip()]
    if isinstance(data, list):
        data = {str(name): i for i, name in enumerate(data)}
    if not isinstance(data, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in data.values()):
        raise PrepareError(f"label_map: {path} must map label names to non-negative integer ids")
    if len(set(data.values())) != len(data):
        raise PrepareError(f"label_map: {path} gives the same id to several names")
    return {str(k): int(v) for k, v in data.items()}


def declared_label_map(units: list[Unit]) -> dict[str, int] | None:
    """The ids a source declares for its classes (Hugging Face ``ClassLabel`` names, in order), or None."""
    names = hf_parquet.class_names(units)
    return {name: i for i, name in enumerate(names)} if names else None


def _warn_renumbered(default_map: dict[str, int]) -> None:
    """Says when class ids given as integers got other ids, because some id had no image."""
    moved = renumbered(default_map)
    if moved:
        log.warning("prepare: the integer labels %s got the ids %s, since some class ids have no images; "
                    "pass --label-map FILE (the class names in id order) to keep each id",
                    ", ".join(moved[:5]) + (", ..." if len(moved) > 5 else ""),
                    ", ".join(str(default_map[n]) for n in moved[:5]) + (", ..." if len(moved) > 5 else ""))


def _inside(child: str, parent: str) -> bool:
    fc, pc = url_to_fs(child)
    fp, pp = url_to_fs(parent)
    c, p = fc.unstrip_protocol(pc), fp.unstrip_protocol(pp)
    return c == p or c.startswith(p.rstrip("/") + "/")


def stated_counts(cfg: PrepareConfig) -> list[tuple[str, str, int]]:
    """(input, split, samples) of each input whose timm ``_info.json`` states the size of the split read."""
    if cfg.format not in ("auto", webdataset.NAME):
        return []
    return [(src, *found) for src in cfg.input for found in [webdataset.stated_samples(src, cfg.split)] if found]


def check_stated(stated: list[tuple[str, str, int]], inputs: list[str], read: int) -> str | None:
    """A one-line warning when the samples read differ from what the inputs' ``_info.json`` state;
    None when they agree or some input states no count (then there is nothing to compare)."""
    if not stated or len(stated) != len(inputs) or sum(n for *_, n in stated) == read:
        return None
    said = "; ".join(f"{src}: _info.json states {n} samples in split {split!r}" for src, split, n in stated)
    return (f"{said}; {read} were read. A shard may be missing, truncated or of another split; "
            "check the shards against _info.json")


def _plan_source(src: str, cfg: PrepareConfig, chosen: list[str]) -> list[Unit]:
    """The units of one input, read as ``--format``; with ``auto``, the line that says which reader was chosen."""
    fmt = cfg.format
    if fmt == "auto":
        fmt = detect_format(src)
        chosen.append(f"prepare: {src}: read as {fmt} (auto; name another with --format)")
    return plan(src, fmt=fmt, options=cfg.plan_options())


def plan_inputs(cfg: PrepareConfig, chosen: list[str] | None = None) -> list[Unit]:
    """Every input's units, or a PrepareError naming the input that has none or cannot be read.

    With ``--format auto``, a line per input naming the reader it was given is added to ``chosen``.
    """
    runners.check_process_local(cfg)
    for src in cfg.input:
        if _inside(cfg.output, src):
            raise PrepareError(
                f"output {cfg.output} is inside input {src}; write the shard set to a separate directory"
            )
    units: list[Unit] = []
    for src in cfg.input:
        try:
            found = _plan_source(src, cfg, [] if chosen is None else chosen)
        except SourceError as exc:
            raise PrepareError(f"input: {exc}") from None
        if not found:
            # An empty shard set would only fail later, in pre-training, far from the cause.
            raise PrepareError(
                f"input: {src}: nothing to ingest (no files, manifest rows or shards; hidden files are skipped); "
                "check the path"
            )
        units.extend(found)
    if cfg.labels:
        try:
            units = label_files(units, cfg.labels, cfg.synsets)
        except SourceError as exc:
            raise PrepareError(str(exc)) from None
    return units


def _open_output(cfg: PrepareConfig) -> PrepareConfig:
    """``cfg`` with its output made durable and created, or a PrepareError naming the fix."""
    try:
        cfg = dataclasses.replace(cfg, output=durable_path(cfg.output, "output"))
        tracking.tracking_uri()
    except InputError as exc:  # a result that would vanish with Ray's uploaded working dir
        raise PrepareError(str(exc)) from None
    fs, root = url_to_fs(cfg.output)
    try:
        fs.makedirs(root, exist_ok=True)
    except OSError as exc:
        raise PrepareError(f"output: cannot create {cfg.output} ({exc}); pass a writable directory") from None
    return cfg


def _set_name(output: str) -> str:
    """A shard set's readable name for run names: its folder, with the parent's for a split
    folder (``digits/train800`` rather than ``train800``)."""
    parts = [p for p in str(output).rstrip("/").split("/") if p]
    if len(parts) >= 2 and re.match(r"(train|val|test|dev)", parts[-1]):
        return "/".join(parts[-2:])
    return parts[-1] if parts else str(output)


@dataclasses.dataclass
class _Job:
    """What every attempt of one ``prepare`` run shares."""

    cfg: PrepareConfig
    folder: OutputFolder
    engine: runners.Engine
    run: Any  # the MLflow run
    plan: list[str]  # the plan's chunk files
    units: int
    known_inputs: int | None
    label_map: Mapping[str, int] | None
    test_sets: dict[str, str]
    index: Any = None  # the test sets' index, when there are test sets
    stated: list = dataclasses.field(default_factory=list)  # (input, split, samples) its _info.json states

    @property
    def fs(self):
        return self.folder.fs

    @property
    def root(self) -> str:
        return self.folder.root


def _test_set_index(cfg: PrepareConfig, test_sets: dict[str, str]):
    if not test_sets:
        return None
    from pipelines.testsets import build_test_set_index

    t_index = time.perf_counter()
    index = build_test_set_index(test_sets, max_bytes=int(cfg.max_file_mb * 1e6), allowed_roots=cfg.roots())
    tracking.log_metrics({"test_set_index_s": time.perf_counter() - t_index, "test_set_images": len(index)})
    return index


def _interrupted(job: _Job, exc: KeyboardInterrupt) -> Interrupted:
    tracking.end_active_run("KILLED")
    output = job.cfg.output
    kept = (f"{output} keeps the shard set it held before" if job.folder.old_manifest() is not None
            else f"no shard set was written to {output}") + " (the ingest starts over when re-run)"
    return Interrupted(getattr(exc, "signum", signal.SIGINT), kept)


def _attempt(job: _Job, run_cfg: PrepareConfig) -> tuple[str, Any]:
    """Run the pipeline once into a new staging folder; returns (that folder, the finished pipeline)."""
    fs = job.fs
    folder = staging.new_folder(fs, job.root)
    fs.makedirs(f"{folder}/shards", exist_ok=True)
    options = runners.pipeline_options(run_cfg, dask_address=job.engine.address, partitions=len(job.plan))
    channel = worker_counts.channel_dir(folder, fs)
    line = ProgressLine("prepare")
    watch = IngestProgress(line, worker_counts.Totals(channel).poll if channel else None, job.units, job.known_inputs)
    reaper = direct_runner.WorkerReaper()
    try:
        with Ticker(watch.tick, min(TTY_EVERY, line.every) if line.enabled else 60.0), interrupts(reaper), \
                runners.pipeline(run_cfg, options) as p:
            build_pipeline(p, job.plan, job.cfg, job.label_map, job.index, fs.unstrip_protocol(f"{folder}/shards"),
                           fs.unstrip_protocol(folder), channel)
        watch.finish()
    except KeyboardInterrupt as exc:
        raise _interrupted(job, exc) from None
    finally:
        reaper.close()
        worker_counts.close(channel)  # the in-process runner's counts file is this process's
    return folder, p


def _reconciled(job: _Job) -> tuple[tuple[dict, list, list], str, Any]:
    """Run the pipeline until its outputs add up, :data:`MAX_ATTEMPTS` times at most.

    Returns ((manifest, quarantine, duplicates), the staging folder, the finished pipeline).
    """
    cfg = run_cfg = job.cfg
    for attempt in range(1, MAX_ATTEMPTS + 1):
        folder, p = _attempt(job, run_cfg)
        outputs = staging.read_outputs(job.fs, folder)
        try:
            summary = summarise(outputs, cfg.output, cfg.input, job.label_map, job.test_sets)
            summary[0]["attempts"] = attempt
            return summary, folder, p
        except AccountingError as exc:
            # Kept for the bug report: the run's artifacts, and the staging folder of the last attempt.
            tracking.log_text(staging.jsonl(outputs).decode(), f"failed_attempt_{attempt}/outputs.jsonl")
            if attempt == MAX_ATTEMPTS:
                raise AccountingError(
                    f"{exc}. No manifest was written after {attempt} attempts. This is a bug; please report it "
                    f"with {folder} and the MLflow run {job.run.info.run_id} (failed_attempt_*/outputs.jsonl)"
                ) from None
            run_cfg = runners.retry_config(run_cfg)
            log.warning("prepare: attempt %d: %s; running the pipeline again%s", attempt, exc,
                        " in one process (--workers 1)" if run_cfg is not cfg else "")
            job.fs.rm(folder, recursive=True)
    raise AssertionError("unreachable")


def _log_run(job: _Job, summary: tuple[dict, list, list], wall: float, p) -> None:
    """The run's metrics, tags and files in MLflow."""
    manifest, quarantine, duplicates = summary
    fs, root, cfg = job.fs, job.root, job.cfg
    written = schema.shard_set_record(fs.unstrip_protocol(root))
    tracking.set_tags({tracking.TAG_OUTPUT_MANIFEST: written["manifest_sha256"],
                       tracking.TAG_DEDUP_STATE: written["dedup_state"]})
    metrics = run_metrics(manifest, wall, job.engine.workers)
    if runners.is_dask(cfg):
        metrics.update({"dask_workers": job.engine.workers, "dask_startup_s": job.engine.startup_s})
    metrics.update({f"beam.{k}": v for k, v in runners.beam_counters(p, cfg).items()})
    tracking.log_metrics(metrics)
    if is_local(fs):
        for name in (schema.MANIFEST, schema.QUARANTINE, schema.DUPLICATES):
            tracking.log_artifact(f"{root}/{name}")
    else:
        tracking.log_dict(manifest, schema.MANIFEST)
        tracking.log_text(staging.jsonl(quarantine).decode(), schema.QUARANTINE)
        tracking.log_text(staging.jsonl(duplicates).decode(), schema.DUPLICATES)


def _check_written(job: _Job, summary: tuple[dict, list, list], staged: list[str]) -> None:
    """Refuse a run that wrote no image, before the swap: an empty set would only fail in the next stage."""
    manifest, quarantine, _ = summary
    empty = nothing_written(manifest, quarantine)
    if empty is None:
        warning = dominant_rejection(manifest, quarantine)
        if warning:
            print(f"prepare: warning: {job.cfg.output}: {warning}", file=sys.stderr)
        return
    tracking.log_text(staging.jsonl(quarantine).decode(), schema.QUARANTINE)
    for folder in staged:
        job.fs.rm(folder, recursive=True)
    kept = "the shard set already there is kept" if job.folder.old_manifest() is not None else "no shard set was written"
    raise PrepareError(f"{job.cfg.output}: {empty}; {kept} (every rejection: {schema.QUARANTINE} of MLflow run "
                       f"{job.run.info.run_id})")


def run_prepare(cfg: PrepareConfig) -> dict:
    """Run the ingest described by ``cfg`` and return the manifest (also written to ``cfg.output``).

    Raises:
        PrepareError: a missing input, bad label map or unusable output, before anything is written; or
            a run that wrote no image (the set already in the folder is kept).
        AccountingError: the counts do not reconcile; no manifest is written.
    """
    from pipelines.testsets import check_sources

    chosen: list[str] = []
    units = plan_inputs(cfg, chosen)
    stated = stated_counts(cfg)
    cluster_workers = runners.check_dask(cfg)
    label_map = load_label_map(cfg.label_map) if cfg.label_map else declared_label_map(units)
    test_sets = cfg.test_sets()
    check_sources(test_sets)
    cfg = _open_output(cfg)
    space.warn_if_short(cfg.output, cfg.input)
    params = vconfig.to_dict(cfg)
    # One writer per folder; the set already there stays readable until swap() (pipelines/output.py).
    with OutputFolder(cfg.output, cfg.input, overwrite=cfg.overwrite) as folder, \
            runners.engine(cfg, cluster_workers) as engine, \
            tracking.start_run("prepare", params=params, parent_run_id=cfg.parent_run_id,
                               run_name=f"prepare {_set_name(cfg.output)}", tags=tracking.run_tags(cfg)) as run:
        for line in chosen:  # said once the run is sure to start, so that a refusal stays one line
            print(line, file=sys.stderr)
        fs, root = folder.fs, folder.root
        staging.clean_leftovers(fs, root)
        try:
            with space.quiet_disk_errors():
                plan_dir = staging.new_folder(fs, root, "plan")
                job = _Job(cfg, folder, engine, run, staging.write_plan(units, fs.unstrip_protocol(plan_dir)),
                           len(units), worker_counts.known_inputs(units), label_map, test_sets, stated=stated)
                del units  # the plan is in its files now; the driver does not hold it while the job runs
                return _ingest(job, plan_dir)
        except Exception as exc:
            code = space.disk_error(exc)
            if code is None:
                raise
            with contextlib.suppress(OSError):  # this run's staging, not left for the next run
                staging.clean_leftovers(fs, root)
            raise PrepareError(space.disk_message(code, cfg.output, cfg.input)) from None


def _ingest(job: _Job, plan_dir: str) -> dict:
    """Run and reconcile the pipeline of ``job``'s plan, then swap its set into the output; returns the manifest."""
    cfg, fs, run = job.cfg, job.fs, job.run
    job.index = _test_set_index(cfg, job.test_sets)

    t0 = time.perf_counter()
    summary, folder_of_run, p = _reconciled(job)
    wall = time.perf_counter() - t0
    manifest, quarantine, duplicates = summary
    _warn_renumbered(manifest["label_map"] if job.label_map is None else {})
    manifest["mlflow_run_id"] = run.info.run_id
    manifest["config"] = vconfig.to_dict(cfg)
    _check_written(job, summary, [folder_of_run, plan_dir])
    warning = check_stated(job.stated, cfg.input, manifest["counts"]["inputs"])
    if warning:
        print(f"prepare: warning: {warning}", file=sys.stderr)

    job.folder.swap(f"{folder_of_run}/shards", manifest,
                     {schema.QUARANTINE: staging.jsonl(quarantine), schema.DUPLICATES: staging.jsonl(duplicates)})
    # With it go the temporary files of workers killed while writing a shard (the task ran again elsewhere).
    fs.rm(folder_of_run, recursive=True)
    fs.rm(plan_dir, recursive=True)
    _log_run(job, summary, wall, p)
    if job.folder.held_signal:  # it came during the swap: the new set is whole and logged, then the stage stops
        tracking.end_active_run("FINISHED")
        raise Interrupted(job.folder.held_signal, f"{cfg.output} holds the new shard set, complete")
    return manifest
