"""Fine-tuning a pre-trained ViT with Ray Tune: the paper's protocol (Section 3.2, Appendix B.1.1).

For fine-tuning the paper removes the whole pre-trained head and attaches one zero-initialised
D×K linear layer, trains with SGD with momentum 0.9, batch 512, no weight decay, global-norm
clipping at 1, a short warm-up then cosine decay. It picks the learning rate from a small grid
by accuracy on a development sub-split of the training set (10% for Pets and Flowers, 2% for
CIFAR, 1% for ImageNet), and "for final results we train on the entire training set and evaluate
on the respective test data". Fine-tuning at a higher resolution than pre-training interpolates
the position embeddings; ImageNet results also use Polyak averaging with factor 0.9999.

So a fine-tune is two Tune sweeps under one MLflow run: ``select`` (one trial per rate, trained
on train minus dev, scored on dev) and ``final`` (one trial at the chosen rate on all of train,
scored on test). Test accuracies of the selection trials are logged for inspection only; nothing
reads them to choose. Each trial is a plain function trainable (one process, ``cpus_per_trial``
CPUs, ``gpus_per_trial`` of a GPU, fractions allowed) and its own MLflow run nested under the
fine-tune run (Tune's own MLflow logging comes out flat).

Batch 512 fits any device through gradient accumulation: ``batch_size`` is the optimiser batch
and ``microbatch`` what goes through the model at once (:mod:`transfer.sgd`).

Sweeps live under ``OUTPUT/ray/<name>``; running the same command again after an interruption
restores them (finished trials are kept, unfinished and errored ones run again) and reopens the
same MLflow run (:mod:`transfer.sweep`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import field
from pathlib import Path
from typing import Any

from common import tracking
from common.config import ConfigError, check, not_recipe
from common.fs import atomic_write, make_output_dir
from common.jobenv import durable_path
from common.locks import FolderLock, check_owner, claim_folder, reading
from pipelines.schema import MANIFEST, ShardSet, missing_manifest_hint, shard_set_record
from training import run_artifacts
from training.ray_utils import init_ray
from transfer.sgd import TrainSpec, check_batching, load_backbone, pretrained_file, start_trial, train_sgd
from transfer.sweep import (
    copy_trial_model,
    manifest_digests,
    open_sweep_state,
    report_final,
    sweep_run,
    trial_resources,
    tune_sweep,
)

PAPER_LR_GRID = [0.001, 0.003, 0.01, 0.03]
# Appendix B.1.1: the development sub-split per dataset, matched against --dataset or the
# train folder's name; anything else gets DEFAULT_DEV_FRACTION.
PAPER_DEV_FRACTIONS = {"pets": 0.1, "flowers": 0.1, "cifar": 0.02, "imagenet": 0.01}
DEFAULT_DEV_FRACTION = 0.1
SUMMARY = "finetune_summary.json"


@dataclasses.dataclass
class FinetuneConfig:
    """Fine-tune a pre-trained ViT: pick the learning rate on a dev sub-split with Ray Tune, retrain on all of train."""

    train: str = field(metadata={"help": "shard directory of the downstream training split"})
    test: str = field(metadata={"help": "shard directory of the downstream test split"})
    pretrained: str | None = field(
        default=None, metadata={"help": "model.safetensors written by pretrain; none trains from scratch"}
    )
    variant: str = field(default="Ti/16", metadata={"help": "vitcore variant when training from scratch"})
    output: str = field(default="finetune_output", metadata={"recipe": False, "help": "directory for the final model and Tune state; "
                                                                       "re-running with the same one resumes"})
    img_size: int | None = field(default=None, metadata={"help": "fine-tuning resolution; default: the pre-training one"})
    lrs: list[float] = field(default_factory=lambda: list(PAPER_LR_GRID), metadata={"help": "SGD learning rates to try"})
    steps: int = field(default=500, metadata={"help": "SGD steps per trial"})
    batch_size: int = field(default=512, metadata={"help": "optimiser batch (the paper: 512 for every run)"})
    microbatch: int = field(default=0, metadata={"recipe": False, "help": "images per forward/backward, accumulated up to "
                                                          "--batch-size (0: the whole batch at once)"})
    warmup_steps: int = field(default=500, metadata={"help": "linear warm-up steps; capped at 10% of the steps"})
    grad_clip: float = field(default=1.0, metadata={"help": "global gradient-norm clip; 0 disables"})
    crop_min_area: float = field(default=0.05, metadata={"help": "Inception-crop minimum area (1.0: no crop)"})
    flip: bool = field(default=True, metadata={"help": "random horizontal flips (off where a flip changes the label)"})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    polyak: float = field(default=0.0, metadata={"help": "Polyak (exponential) averaging decay of the evaluated "
                                                          "weights, e.g. 0.9999 (0: off)"})
    layer_decay: float | None = field(default=None, metadata={"off": None, "help": "layer-wise learning-rate decay: each layer's rate is the base rate x this^(L - layer), the head at L, the patch embedding at 0 (BEiT, timm: e.g. 0.65-0.75; default: one rate for all)"})
    dataset: str | None = field(default=None, metadata={"help": "dataset name for the dev fraction (pets, flowers, "
                                                                "cifar, imagenet, ...); default: from the train folder's name"})
    dev_fractions: dict[str, float] = field(default_factory=lambda: dict(PAPER_DEV_FRACTIONS),
                                            metadata={"help": "JSON {dataset: dev fraction} (Appendix B.1.1)"})
    val_fraction: float | None = field(default=None, metadata={"help": "dev share of train used to pick the rate; "
                                                                       "overrides --dataset's fraction"})
    eval_every: int = field(default=0, metadata={"help": "evaluate every N steps (0: only at the end)"})
    cpus_per_trial: int = field(default=1, metadata={"recipe": False, "help": "CPUs per trial (and torch threads)"})
    gpus_per_trial: float = field(default=0, metadata={"recipe": False, "help": "GPUs per trial; fractions share one GPU"})
    max_concurrent: int = field(default=0, metadata={"recipe": False, "help": "trials at once (0: as resources allow)"})
    max_failures: int = field(default=2, metadata={"recipe": False, "help": "retries of a failed trial"})
    bf16: bool = field(default=True, metadata={"help": "bf16 autocast on GPU (ignored on CPU)"})
    seed: int = field(default=0, metadata={"help": "seed for the split, init, shuffling and augmentation"})
    ray_address: str | None = field(default=None, metadata={"recipe": False, "help": "Ray cluster address; default: RAY_ADDRESS or in-process"})
    parent_run_id: str | None = field(default=None, metadata={"recipe": False, "help": "MLflow run to nest under"})
    data_changed_ok: bool = field(default=False, metadata={"recipe": False, "help": "resume the sweep in --output even "
                                                                                  "though --train or --test was replaced since it started"})

    def __post_init__(self) -> None:
        check(len(self.lrs) > 0, "lrs", "give at least one learning rate")
        check(all(lr > 0 for lr in self.lrs), "lrs", f"every learning rate must be positive, got {self.lrs}")
        for name in ("steps", "batch_size", "cpus_per_trial"):
            check(getattr(self, name) > 0, name, f"must be a positive integer, got {getattr(self, name)}")
        check_batching(self.batch_size, self.microbatch)
        check(self.val_fraction is None or 0 < self.val_fraction < 0.5, "val_fraction",
              f"must be in (0, 0.5), got {self.val_fraction}")
        for name, frac in self.dev_fractions.items():
            check(0 < float(frac) < 0.5, "dev_fractions", f"{name}: must be in (0, 0.5), got {frac}")
        check(self.img_size is None or self.img_size > 0, "img_size", f"must be positive, got {self.img_size}")
        check(0 < self.crop_min_area <= 1, "crop_min_area", f"must be in (0, 1], got {self.crop_min_area}")
        check(0 <= self.momentum < 1, "momentum", f"must be in [0, 1), got {self.momentum}")
        check(0 <= self.polyak < 1, "polyak", f"must be in [0, 1), got {self.polyak}")
        check(self.layer_decay is None or 0 < self.layer_decay <= 1, "layer_decay",
              f"must be in (0, 1] (1: one rate for all), got {self.layer_decay}")
        check(self.gpus_per_trial >= 0, "gpus_per_trial", f"must be >= 0, got {self.gpus_per_trial}")
        check(self.max_failures >= 0, "max_failures", f"must be >= 0, got {self.max_failures}")

    def dev_fraction(self) -> float:
        """The held-out share of train: --val-fraction, else --dataset's (or the train folder's) paper fraction."""
        if self.val_fraction is not None:
            return self.val_fraction
        name = (self.dataset or Path(self.train).name).lower()
        for key, frac in self.dev_fractions.items():
            if key.lower() == name or (self.dataset is None and key.lower() in name):
                return float(frac)
        return DEFAULT_DEV_FRACTION


def finetune_trial(config: dict) -> None:
    """One learning rate. ``phase="select"``: train on train minus dev, report dev (val) accuracy
    (and test, logged only). ``phase="final"``: train on all of train, report test accuracy."""
    from ray import tune
    from torch.utils.data import DataLoader

    from training.data import ShardImageDataset, eval_transform, split_rows, train_transform
    from training.loop import evaluate

    cfg = FinetuneConfig(**config["cfg"])
    lr, phase = float(config["lr"]), config["phase"]
    device = start_trial(cfg.cpus_per_trial, cfg.gpus_per_trial, cfg.seed)
    uri = config["mlflow_uri"]
    run_id = tracking.create_child_run(config["mlflow_parent"], f"{phase} lr={lr:g}", stage=f"finetune-{phase}",
                                       params={"lr": lr, "phase": phase, **config["cfg"]}, uri=uri)
    try:
        train_set = ShardSet(cfg.train)
        model = load_backbone(cfg.pretrained, cfg.variant, cfg.img_size, len(train_set.label_map)).to(device)
        img_size = model.config.img_size[0]
        fit_rows, dev_rows = split_rows(len(train_set), cfg.dev_fraction(), cfg.seed)
        if phase == "final":
            fit_rows = None  # the entire training split
        train_ds = ShardImageDataset(train_set, train_transform(img_size, flip=cfg.flip, min_area=cfg.crop_min_area),
                                     rows=fit_rows, seed=cfg.seed)
        test_loader = DataLoader(ShardImageDataset(cfg.test, eval_transform(img_size)), batch_size=256)
        dev_loader = DataLoader(ShardImageDataset(train_set, eval_transform(img_size), rows=dev_rows), batch_size=256)
        spec = TrainSpec(lr=lr, steps=cfg.steps, batch_size=cfg.batch_size, microbatch=cfg.microbatch,
                         warmup_steps=cfg.warmup_steps, grad_clip=cfg.grad_clip, momentum=cfg.momentum,
                         polyak=cfg.polyak, layer_decay=cfg.layer_decay, bf16=cfg.bf16, seed=cfg.seed)

        def on_eval(m, step, loss):
            metrics = {"step": step, "train_loss": loss, "lr": lr}
            if phase == "select":
                metrics["val_accuracy"] = evaluate(m, dev_loader, device, cfg.bf16)["accuracy"]
            tracking.log_metrics_to(run_id, metrics, step=step, uri=uri)
            tune.report(metrics)

        evaluated, stats = train_sgd(model, train_ds, spec, device, on_eval=on_eval, eval_every=cfg.eval_every)
        metrics = {"step": cfg.steps, "lr": lr, "train_loss": stats["train_loss"],
                   "images_per_second": stats["images_per_second"], "train_rows": len(train_ds)}
        if phase == "select":
            dev = evaluate(evaluated, dev_loader, device, cfg.bf16)
            metrics.update(val_loss=dev["loss"], val_accuracy=dev["accuracy"])
        test = evaluate(evaluated, test_loader, device, cfg.bf16)
        metrics.update(test_loss=test["loss"], test_accuracy=test["accuracy"])
        tracking.log_metrics_to(run_id, metrics, step=cfg.steps, uri=uri)
        report_final(metrics, evaluated, train_set.label_names)
        tracking.end_run(run_id, uri=uri)
    except BaseException:
        tracking.end_run(run_id, failed=True, uri=uri)
        raise


def _resolve_inputs(cfg: FinetuneConfig) -> FinetuneConfig:
    resolved = {}
    for name in ("train", "test"):
        path = Path(getattr(cfg, name)).expanduser().resolve()
        if not (path / MANIFEST).is_file():
            raise ConfigError(f"{name}: {path} has no {MANIFEST}; {missing_manifest_hint(path)}")
        resolved[name] = str(path)
    if cfg.pretrained is not None:
        resolved["pretrained"] = str(pretrained_file(cfg.pretrained))
    return dataclasses.replace(cfg, **resolved)


def _check_splits(cfg: FinetuneConfig) -> tuple[ShardSet, float]:
    """The training split and its dev fraction, once both splits are known to be usable."""
    from training.data import check_labelled, split_rows

    train_set, test_set = ShardSet(cfg.train), ShardSet(cfg.test)
    for split, shards in (("train", train_set), ("test", test_set)):
        check_labelled(shards, split, unlabelled_fix="fine-tuning needs labelled splits: prepare them from class "
                       "folders or a manifest with a label column",
                       several_fix="fine-tuning trains a single-label classifier; prepare it with one label a row")
    train_map, test_map = train_set.label_map, test_set.label_map
    if train_map != test_map:
        raise ConfigError(
            f"test: label map of {cfg.test} ({len(test_map)} labels) differs from train's ({len(train_map)}); "
            "prepare both splits with the same --label-map"
        )
    dev_fraction = cfg.dev_fraction()
    # Refused here rather than as a DataLoader error inside every trial.
    fit_rows, dev_rows = split_rows(len(train_set), dev_fraction, cfg.seed)
    if len(fit_rows) == 0 or len(dev_rows) == 0:
        raise ConfigError(
            f"train: {cfg.train} has {len(train_set)} rows, too few to hold out {dev_fraction:g} of them for "
            "choosing the learning rate and train on the rest; check its quarantine.jsonl or ingest more images"
        )
    if len(test_set) == 0:
        raise ConfigError(f"test: {cfg.test} has no rows; check its quarantine.jsonl or ingest more images")
    return train_set, dev_fraction


def _select(cfg: FinetuneConfig, common: dict, output: Path) -> tuple[list[dict], list[dict], dict]:
    """The selection sweep's trials, its failures, and the trial with the best dev accuracy."""
    from ray import tune

    grid = tune_sweep(finetune_trial, {"lr": tune.grid_search(list(cfg.lrs)), "phase": "select", **common},
                      name="select", output=output, resources=trial_resources(cfg.cpus_per_trial, cfg.gpus_per_trial),
                      metric="val_accuracy", max_concurrent=cfg.max_concurrent, max_failures=cfg.max_failures)
    rows, failed = [], []
    for result in grid:
        lr = result.config["lr"]
        if result.error or not result.metrics or "val_accuracy" not in result.metrics:
            failed.append({"lr": lr, "error": str(result.error)})
            continue
        m = result.metrics
        rows.append({k: m[k] for k in ("lr", "train_loss", "val_accuracy", "test_accuracy")})
    if not rows:
        raise RuntimeError(f"every fine-tuning trial failed: {failed}")
    rows.sort(key=lambda r: r["lr"])
    # Ties go to the smaller rate (rows are sorted); test accuracy is never looked at here.
    return rows, failed, max(rows, key=lambda r: r["val_accuracy"])


def _final(cfg: FinetuneConfig, common: dict, output: Path, lr: float) -> tuple[Any, Path]:
    """The final trial at ``lr`` on all of train, and its model copied into ``output``."""
    final = tune_sweep(finetune_trial, {"lr": lr, "phase": "final", **common}, name="final", output=output,
                       resources=trial_resources(cfg.cpus_per_trial, cfg.gpus_per_trial), metric="test_accuracy",
                       max_failures=cfg.max_failures)
    result = final[0]
    if result.error or not result.metrics or "test_accuracy" not in result.metrics:
        raise RuntimeError(f"the final fine-tune at lr={lr:g} on all of train failed: {result.error}")
    return result, copy_trial_model(result, output, "finetune")


def _publish(summary: dict, name: str, output: Path, run, label_names) -> None:
    """The fine-tune run's metrics, grid plot, lineage, model and summary, in MLflow and in ``output``."""
    tracking.log_metrics({"selected_lr": summary["selected_lr"],
                          "val_accuracy": summary["selected_val_accuracy"],
                          "test_accuracy": summary["test_accuracy"]})
    tracking.set_tags({"mlflow.runName": f"{name} lr={summary['selected_lr']:g}"})
    grid_png = run_artifacts.finetune_grid(summary["trials"], summary["selected_lr"], summary["test_accuracy"],
                                           output / run_artifacts.FINETUNE_GRID,
                                           title=f"{name}: accuracy per learning rate")
    tracking.log_artifact(grid_png, "plots")
    tracking.write_lineage(output, run, "finetune")
    from vitcore.checkpoint import check_checkpoint

    variant = check_checkpoint(summary["model"]).variant
    info = run_artifacts.log_vit_model(Path(summary["model"]), labels=label_names,
                                       name=run_artifacts.model_name("finetune", variant, Path(summary["train"]).name),
                                       metadata={"vitscale.finetune_run_id": run.info.run_id})
    summary["mlflow_model_uri"] = info.model_uri
    tracking.log_dict(summary, SUMMARY)
    atomic_write(output / SUMMARY, json.dumps(summary, indent=2))


def _finished(output: Path, state: dict | None) -> dict | None:
    """The summary of the fine-tune ``output`` holds when it finished under the sweep run ``state``
    names; a re-run returns it rather than log a second model into that run."""
    try:
        summary = json.loads((output / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    return summary if state and summary.get("mlflow_run_id") == state.get("mlflow_run_id") else None


def run_name(cfg: FinetuneConfig, set_name: str) -> str:
    """The MLflow run's name: the dataset when ``--dataset`` names it, else the training set's name."""
    return f"finetune {cfg.dataset or set_name}" + (f" from {Path(cfg.pretrained).parent.name}" if cfg.pretrained else "")


def run_finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Select the learning rate on the dev sub-split, retrain on all of train at that rate, test it."""
    cfg = _resolve_inputs(cfg)
    train_set, dev_fraction = _check_splits(cfg)
    output = Path(durable_path(cfg.output, "output")).expanduser().resolve()
    uri = tracking.tracking_uri()  # refuses a store in Ray's uploaded copy before any trial runs
    # One sweep at a time in an output folder: two would restore the same sweep and run its trials twice.
    check_owner(output, "finetune")
    # The splits stay as they are for the sweep: a prepare replacing one, or a dedup, is refused.
    with reading("finetune", {"train": cfg.train, "test": cfg.test}), FolderLock(make_output_dir(output), "finetune"):
        claim_folder(output, "finetune")
        return _run_sweeps(cfg, output, uri, train_set, dev_fraction)


def _run_sweeps(cfg: FinetuneConfig, output: Path, uri: str, train_set: ShardSet, dev_fraction: float) -> dict[str, Any]:
    config = dataclasses.asdict(cfg)
    train_record = shard_set_record(cfg.train, role="training")
    records = [train_record, shard_set_record(cfg.test, role="evaluation")]
    data = manifest_digests({"train": records[0], "test": records[1]})
    # Where Ray runs and how many trials at once do not change the sweep's results.
    state = open_sweep_state(output, config, stage="finetune", fresh_keys=not_recipe(cfg), data=data,
                             data_changed_ok=cfg.data_changed_ok)
    finished = _finished(output, state)
    if finished:  # nothing to resume: the same run, model and summary stand
        return finished
    init_ray(cfg.ray_address)

    upstream = [u for u in ([tracking.read_lineage(cfg.pretrained)] if cfg.pretrained else []) if u]
    name = run_name(cfg, train_record["name"])
    new = {"params": config, "parent_run_id": cfg.parent_run_id, "run_name": name,
           "tags": tracking.run_tags(cfg, data=records, main=[train_record], models=upstream)}
    with sweep_run("finetune", output, config, state, records=records, new=new, data=data,
                   log_system_metrics=True) as run:
        common = {"cfg": config, "mlflow_parent": run.info.run_id, "mlflow_uri": uri}
        rows, failed, best = _select(cfg, common, output)
        result, model_path = _final(cfg, common, output, best["lr"])
        summary = {
            "trials": rows,
            "failed": failed,
            "dev_fraction": dev_fraction,
            "selected_lr": best["lr"],
            "selected_val_accuracy": best["val_accuracy"],
            "test_accuracy": result.metrics["test_accuracy"],
            "final_train_rows": result.metrics["train_rows"],
            "model": str(model_path),
            "train": cfg.train,
            "label_map": train_set.label_map,
            "mlflow_run_id": run.info.run_id,
        }
        _publish(summary, name, output, run, train_set.label_names)
    return summary
