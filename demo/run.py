"""The end-to-end demo: corpus → Beam ingest with test-set de-duplication → Ray Train → Ray Tune → MLflow.

Every stage is the same library call its own entrypoint makes (``jobs/prepare.py``,
``jobs/dedup.py``, ``jobs/pretrain.py``, ``jobs/finetune.py``, ``jobs/vtab.py``, ``jobs/fewshot.py``),
sized to finish in minutes on two CPU cores. Each stage's run goes into its stage's experiment
(``common.tracking``) and names the ``demo`` run that grouped them (``vitscale.demo_run_id``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import field
from pathlib import Path
from typing import Any, Iterator

from common import tracking
from common.config import check
from common.fs import atomic_write, make_output_dir
from common.progress import paused
from dedup.job import DedupConfig
from dedup.job import run as run_dedup
from demo import data as demo_data
from pipelines.config import PrepareConfig
from pipelines.ingest import run_prepare
from reports.report import ReportConfig, run_report
from training.pretrain import PretrainConfig, run_pretrain
from training.ray_utils import init_ray
from transfer.fewshot import FewshotConfig, run_fewshot
from transfer.fewshot import format_table as fewshot_table
from transfer.finetune import FinetuneConfig, run_finetune
from transfer.vtab import VtabConfig, run_vtab
from transfer.vtab import format_table as vtab_table
from transfer.vtab_data import VtabPrepareConfig, run_vtab_prepare


@dataclasses.dataclass
class DemoConfig:
    """Run the whole vitscale chain on a generated corpus, offline, on one machine."""

    workdir: str = field(default="demo_output", metadata={"help": "where data, shards, models and the MLflow store go"})
    variant: str = field(default="Ti/8", metadata={"help": "vitcore variant of the pre-trained model"})
    depth: int = field(default=4, metadata={"help": "blocks (the demo uses a shallow Ti to fit in minutes)"})
    img_size: int = field(default=32, metadata={"help": "pre-training resolution"})
    finetune_img_size: int = field(default=32, metadata={"help": "fine-tuning resolution (Section 3.2: higher than pre-training)"})
    shard_size: int = field(default=48, metadata={"help": "shorter side written by prepare"})
    epochs: int = field(default=12, metadata={"help": "pre-training epochs"})
    batch_size: int = field(default=64, metadata={"help": "pre-training global batch"})
    lr: float = field(default=1e-3, metadata={"help": "pre-training Adam learning rate"})
    finetune_steps: int = field(default=300, metadata={"help": "SGD steps per learning rate"})
    finetune_batch_size: int = field(default=64, metadata={"help": "fine-tuning batch"})
    lrs: list[float] = field(default_factory=lambda: [0.03, 0.1, 0.3], metadata={"help": "fine-tuning learning-rate grid"})
    vtab_train: int = field(default=160, metadata={"help": "VTAB stage: train images per task (VTAB-1k: 800)"})
    vtab_val: int = field(default=40, metadata={"help": "VTAB stage: val images per task (VTAB-1k: 200)"})
    vtab_test: int = field(default=100, metadata={"help": "VTAB stage: test images per task"})
    vtab_lrs: list[float] = field(default_factory=lambda: [0.03, 0.1], metadata={"help": "VTAB stage: learning rates"})
    vtab_steps: list[int] = field(default_factory=lambda: [40, 80], metadata={"help": "VTAB stage: schedules (steps)"})
    fewshot_shots: list[int] = field(default_factory=lambda: [1, 5, 10], metadata={"help": "few-shot stage: images per class"})
    fewshot_draws: int = field(default=3, metadata={"help": "few-shot stage: random draws per shot count"})
    num_workers: int = field(default=2, metadata={"help": "Ray Train workers"})
    prepare_workers: int = field(default=2, metadata={"help": "Beam DirectRunner workers"})
    per_shape: int = field(default=60, metadata={"help": "generated images per shape class"})
    per_photo: int = field(default=24, metadata={"help": "crops per real photograph class"})
    seed: int = field(default=0, metadata={"help": "seed for data generation and training"})
    verbose: bool = field(default=False, metadata={"help": "stream Beam and Ray worker logs to the console"})

    def __post_init__(self) -> None:
        for name in ("img_size", "finetune_img_size", "epochs", "batch_size", "finetune_steps", "num_workers",
                     "per_shape", "per_photo", "prepare_workers", "vtab_train", "vtab_val", "vtab_test"):
            check(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        check(len(self.lrs) > 0, "lrs", "give at least one learning rate")


@contextlib.contextmanager
def _stderr_to(log: Path | None) -> Iterator[None]:
    """Send file descriptor 2 to ``log`` for the duration, subprocesses included.

    Beam's DirectRunner starts its workers as subprocesses that inherit stderr and print
    their start-up warnings there (optional filesystems not installed, unparsed options).
    They are harmless, and the quiet demo keeps them in a log file instead of the console.
    """
    if log is None:
        yield
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(log, "ab") as f:
            os.dup2(f.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _prepare(inputs: list[str], output: Path, *, size: int, workers: int, test_sets: list[str], verbose: bool,
             log: Path) -> dict:
    # Without --verbose the ingest's own worker defaults apply (errors, and this project's warnings).
    options = ["--default_sdk_harness_log_level=INFO"] if verbose else []
    # The corpus ingest shows its progress; the small ones (a few seconds each) only their counts.
    quiet = paused() if workers == 1 else contextlib.nullcontext()
    with _stderr_to(None if verbose or workers == 1 else log), quiet:
        return run_prepare(PrepareConfig(input=inputs, output=str(output), size=size, workers=workers,
                                         test_set=test_sets, beam_options=options))


STAGES = 7


def _stage(n: int, text: str) -> None:
    print(f"==> [{n}/{STAGES}] {text}", flush=True)


def _vtab(cfg: DemoConfig, work: Path, pretrained: str, log: Path) -> tuple[dict, list[str]]:
    """Generate the three tasks, write their train/val/test shard sets with the folders converter
    (the Beam ingest), and run the VTAB protocol on them with the pre-trained model; returns the
    results and the task specs (GROUP/NAME=DIR)."""
    raw = demo_data.build_vtab_tasks(work / "data" / "vtab", train=cfg.vtab_train + cfg.vtab_val,
                                     test=cfg.vtab_test, size=32, seed=cfg.seed)
    specs = []
    for name, src in raw.items():
        out = work / "shards" / "vtab" / name
        with _stderr_to(None if cfg.verbose else log), paused():
            run_vtab_prepare(VtabPrepareConfig(source="folders", input=str(src), output=str(out), size=32,
                                               train_size=cfg.vtab_train, val_size=cfg.vtab_val, seed=cfg.seed))
        specs.append(f"{demo_data.VTAB_TASKS[name]}/{name}={out}")
    return run_vtab(VtabConfig(
        task=specs, no_crop=list(demo_data.VTAB_NO_CROP), no_flip=["digits"], pretrained=pretrained,
        output=str(work / "vtab"), img_size=cfg.finetune_img_size, lrs=list(cfg.vtab_lrs),
        steps=list(cfg.vtab_steps), batch_size=cfg.finetune_batch_size, warmup_steps=5, crop_min_area=0.6,
        seed=cfg.seed,
    )), specs


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    if not cfg.verbose:
        logging.getLogger().setLevel(logging.WARNING)
        logging.getLogger("apache_beam").setLevel(logging.WARNING)
        # The runner relays each worker's start-up warnings as its own.
        logging.getLogger("apache_beam.runners.portability.local_job_service").setLevel(logging.ERROR)
        import mlflow  # noqa: F401  (it sets its loggers to INFO when imported; quieten them after)

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # "Creating initial MLflow database tables..."
    work = make_output_dir(cfg.workdir, "workdir")
    init_ray(log_to_driver=cfg.verbose)
    # The demo is a fresh run each time: its fixed run name would otherwise resume (and so
    # skip) the previous demo's pre-training. The MLflow store is kept, so runs accumulate.
    for stale in ("pretrain", "finetune", "vtab", "fewshot"):
        shutil.rmtree(work / stale, ignore_errors=True)
    # The demo's MLflow store lives with its outputs unless the user points elsewhere.
    os.environ.setdefault("VITSCALE_HOME", str(work / "mlruns"))
    timings: dict[str, float] = {}
    t_all = time.perf_counter()
    config = dataclasses.asdict(cfg)
    with tracking.start_run("demo", params=config, tags=tracking.run_tags(config),
                            run_name=f"demo {cfg.variant} depth {cfg.depth}, {cfg.epochs} epochs") as demo_run:
        os.environ["VITSCALE_PARENT_RUN_ID"] = demo_run.info.run_id
        try:
            _stage(1, "building the corpus and the downstream task")
            t = time.perf_counter()
            data = demo_data.build(work / "data", per_shape=cfg.per_shape, per_photo=cfg.per_photo, seed=cfg.seed)
            timings["data"] = time.perf_counter() - t

            _stage(2, "Beam ingest: corpus (de-duplicated against digits test), digits train, digits test")
            beam_log = work / "logs" / "beam-workers.log"
            t = time.perf_counter()
            corpus = _prepare([str(data.corpus)], work / "shards" / "corpus", size=cfg.shard_size,
                              workers=cfg.prepare_workers, test_sets=[f"digits_test={data.test}"], verbose=cfg.verbose,
                              log=beam_log)
            train = _prepare([str(data.train)], work / "shards" / "digits-train", size=cfg.shard_size,
                             workers=1, test_sets=[], verbose=cfg.verbose, log=beam_log)
            test = _prepare([str(data.test)], work / "shards" / "digits-test", size=cfg.shard_size,
                            workers=1, test_sets=[], verbose=cfg.verbose, log=beam_log)
            timings["prepare"] = time.perf_counter() - t

            _stage(3, "De-duplication job: the corpus shards against the digits test set again")
            t = time.perf_counter()
            # The ingest removed the planted copies already: the scheduled job finds nothing new
            # and records that it checked (the pre-training's dedup lineage).
            dedup = run_dedup(DedupConfig(shards=str(work / "shards" / "corpus"),
                                          test_set=[f"digits_test={data.test}"]))
            timings["dedup"] = time.perf_counter() - t

            _stage(4, f"Ray Train: pre-training {cfg.variant} (depth {cfg.depth}) on {cfg.num_workers} workers")
            t = time.perf_counter()
            pre = run_pretrain(PretrainConfig(
                data=str(work / "shards" / "corpus"), output=str(work / "pretrain"), variant=cfg.variant,
                depth=cfg.depth, img_size=cfg.img_size, epochs=cfg.epochs, batch_size=cfg.batch_size, lr=cfg.lr,
                warmup_steps=50, num_workers=cfg.num_workers, dropout=0.0, log_every=5, seed=cfg.seed, holdout=0.1,
                run_name="demo-pretrain",
            ))
            timings["pretrain"] = time.perf_counter() - t

            _stage(5, f"Ray Tune: fine-tuning over learning rates {list(cfg.lrs)}")
            t = time.perf_counter()
            fine = run_finetune(FinetuneConfig(
                train=str(work / "shards" / "digits-train"), test=str(work / "shards" / "digits-test"),
                pretrained=pre["model"], output=str(work / "finetune"), img_size=cfg.finetune_img_size,
                lrs=list(cfg.lrs), steps=cfg.finetune_steps, batch_size=cfg.finetune_batch_size,
                # Digits: a flip changes the class and a 5%-area crop erases it (cf. VTAB's exclusions).
                warmup_steps=15, flip=False, crop_min_area=0.6, seed=cfg.seed,
            ))
            timings["finetune"] = time.perf_counter() - t

            _stage(6, "VTAB-style: three generated tasks (natural, specialized, structured), "
                      f"{len(cfg.vtab_lrs)} lrs x {len(cfg.vtab_steps)} schedules on Ray Tune")
            t = time.perf_counter()
            vtab, specs = _vtab(cfg, work, pre["model"], beam_log)
            timings["vtab"] = time.perf_counter() - t

            _stage(7, f"Few-shot linear evaluation of the pre-trained model on the same tasks ({list(cfg.fewshot_shots)} shots)")
            t = time.perf_counter()
            fewshot = run_fewshot(FewshotConfig(pretrained=pre["model"], task=specs, output=str(work / "fewshot"),
                                                shots=list(cfg.fewshot_shots), draws=cfg.fewshot_draws,
                                                img_size=cfg.finetune_img_size, device="cpu", seed=cfg.seed))
            timings["fewshot"] = time.perf_counter() - t
        finally:
            os.environ.pop("VITSCALE_PARENT_RUN_ID", None)
        timings["total"] = time.perf_counter() - t_all
        summary = {
            "data": data.to_dict(),
            "prepare": {"corpus": corpus["counts"], "digits_train": train["counts"], "digits_test": test["counts"]},
            "dedup": dedup,
            "pretrain": pre,
            "finetune": fine,
            "vtab": vtab,
            "fewshot": fewshot,
            "timings_s": {k: round(v, 1) for k, v in timings.items()},
            "mlflow_run_id": demo_run.info.run_id,
            "mlflow_ui": tracking.ui_command(),
            "mlflow_experiments": _experiment_urls(),
        }
        tracking.log_metrics({f"time_{k}_s": v for k, v in timings.items()})
        tracking.log_dict(summary, "demo_summary.json")
        tracking.log_text(format_table(summary), "demo_results.txt")
    atomic_write(work / "demo_summary.json", json.dumps(summary, indent=2, default=str))
    # Every run of the store, this demo's and any earlier one's, side by side (jobs/report.py).
    report = run_report(ReportConfig(output=str(work / "report.html")),
                        tags={tracking.TAG_DEMO_RUN: demo_run.info.run_id, tracking.TAG_PARENT_RUN: demo_run.info.run_id})
    summary["report"] = report["output"]
    atomic_write(work / "demo_summary.json", json.dumps(summary, indent=2, default=str))
    return summary


def _experiment_urls() -> dict[str, str]:
    """The UI page of each stage's experiment that holds runs, on the runs table (``tracking.ui_url``)."""
    import mlflow

    client = mlflow.MlflowClient(tracking.tracking_uri())
    urls = {}
    for stage, name in tracking.stage_experiments().items():
        exp = client.get_experiment_by_name(name)
        if exp is not None:
            urls[name] = tracking.ui_url(exp.experiment_id)
    return urls


def format_table(s: dict[str, Any]) -> str:
    c = s["prepare"]["corpus"]
    dups = c.get("duplicates", {})
    rejected = c.get("rejected", {})
    lines = [
        "vitscale demo results",
        "=" * 64,
        "Ingest (Beam, DirectRunner) of the pre-training corpus",
        f"  inputs                       {c['inputs']}",
        f"  written                      {c['written']}",
        f"  rejected                     {sum(rejected.values())}  {dict(sorted(rejected.items()))}",
        f"  exact duplicates (corpus)    {dups.get('corpus', 0)}",
        f"  near-duplicates of test set  {dups.get('digits_test', 0)}  (planted: {s['data']['planted']})",
        "",
        "Pre-training (Ray Train, "
        f"{s['pretrain']['metrics'].get('epoch', 0) + 1} epochs)",
        f"  final train loss             {s['pretrain']['metrics'].get('train_loss', float('nan')):.4f}",
        f"  final train accuracy         {s['pretrain']['metrics'].get('train_accuracy', float('nan')):.3f}",
        f"  held-out accuracy            {s['pretrain']['metrics'].get('holdout_accuracy', float('nan')):.3f}",
        "",
        "Fine-tuning on digits (Ray Tune learning-rate grid, SGD)",
        f"  {'lr':>8}  {'train loss':>10}  {'val acc':>8}  {'test acc':>8}",
    ]
    for row in s["finetune"]["trials"]:
        mark = "  <- selected (best val)" if row["lr"] == s["finetune"]["selected_lr"] else ""
        lines.append(f"  {row['lr']:>8g}  {row['train_loss']:>10.4f}  {row['val_accuracy']:>8.3f}  {row['test_accuracy']:>8.3f}{mark}")
    lines += [
        f"  retrained on all of train at lr {s['finetune']['selected_lr']:g}: test accuracy "
        f"{s['finetune']['test_accuracy']:.3f}  (the result)",
    ]
    if s.get("vtab"):
        lines += ["", vtab_table(s["vtab"])]
    if s.get("fewshot"):
        lines += ["", fewshot_table(s["fewshot"])]
    lines += [
        "",
        "Wall time (s): " + ", ".join(f"{k} {v}" for k, v in s["timings_s"].items()),
        "",
        "Open the MLflow UI on this store:",
        f"  {s['mlflow_ui']}",
        "then each stage's experiment, on its runs table:",
        *(f"  {name:<28} {url}" for name, url in s.get("mlflow_experiments", {}).items()),
    ]
    if s.get("report"):
        lines += ["", "Comparison report of every run in this store (jobs/report.py):", f"  {s['report']}"]
    return "\n".join(lines)
