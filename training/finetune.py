"""Fine-tuning a pre-trained ViT over a learning-rate grid with Ray Tune (Section 3.2, Appendix B.1.1).

For fine-tuning the paper removes the whole pre-trained head and attaches one zero-initialised
D×K linear layer, trains with SGD with momentum 0.9, no weight decay, global-norm clipping at
1, a short warm-up then cosine decay, and picks the learning rate from a small grid by accuracy
on a held-out part of the training set (it sweeps {0.001, 0.003, 0.01, 0.03}). Fine-tuning at
a higher resolution than pre-training interpolates the position embeddings (Section 3.2).

Each grid point is one Tune trial: a plain function trainable (one process, ``cpus_per_trial``
CPUs or one GPU), which is the right size for these runs. Each trial is its own MLflow run,
nested explicitly under the fine-tune run: Tune's own MLflow logging comes out flat.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from dataclasses import field
from pathlib import Path
from typing import Any

from common.config import ConfigError, check
from training.pretrain import MODEL_FILE

PAPER_LR_GRID = [0.001, 0.003, 0.01, 0.03]


@dataclasses.dataclass
class FinetuneConfig:
    """Fine-tune a pre-trained ViT over a learning-rate grid with Ray Tune."""

    train: str = field(metadata={"help": "shard directory of the downstream training split"})
    test: str = field(metadata={"help": "shard directory of the downstream test split"})
    pretrained: str | None = field(
        default=None, metadata={"help": "model.safetensors written by pretrain; none trains from scratch"}
    )
    variant: str = field(default="Ti/16", metadata={"help": "vitcore variant when training from scratch"})
    output: str = field(default="finetune_output", metadata={"help": "directory for the best model and Tune state"})
    img_size: int | None = field(default=None, metadata={"help": "fine-tuning resolution; default: the pre-training one"})
    lrs: list[float] = field(default_factory=lambda: list(PAPER_LR_GRID), metadata={"help": "SGD learning rates to try"})
    steps: int = field(default=500, metadata={"help": "SGD steps per trial"})
    batch_size: int = field(default=512, metadata={"help": "batch size per trial"})
    warmup_steps: int = field(default=500, metadata={"help": "linear warm-up steps; capped at 10% of the steps"})
    grad_clip: float = field(default=1.0, metadata={"help": "global gradient-norm clip; 0 disables"})
    crop_min_area: float = field(default=0.05, metadata={"help": "Inception-crop minimum area (1.0: no crop)"})
    flip: bool = field(default=True, metadata={"help": "random horizontal flips (off where a flip changes the label)"})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    val_fraction: float = field(default=0.1, metadata={"help": "held-out share of train used to pick the learning rate"})
    eval_every: int = field(default=0, metadata={"help": "evaluate every N steps (0: only at the end)"})
    cpus_per_trial: int = field(default=1, metadata={"help": "CPUs per trial (and torch threads)"})
    gpus_per_trial: float = field(default=0, metadata={"help": "GPUs per trial"})
    max_concurrent: int = field(default=0, metadata={"help": "trials at once (0: as resources allow)"})
    bf16: bool = field(default=True, metadata={"help": "bf16 autocast on GPU (ignored on CPU)"})
    seed: int = field(default=0, metadata={"help": "seed for the split, init, shuffling and augmentation"})
    ray_address: str | None = field(default=None, metadata={"help": "Ray cluster address; default: RAY_ADDRESS or in-process"})
    parent_run_id: str | None = field(default=None, metadata={"help": "MLflow run to nest under"})

    def __post_init__(self) -> None:
        check(len(self.lrs) > 0, "lrs", "give at least one learning rate")
        check(all(lr > 0 for lr in self.lrs), "lrs", f"every learning rate must be positive, got {self.lrs}")
        for name in ("steps", "batch_size", "cpus_per_trial"):
            check(getattr(self, name) > 0, name, f"must be a positive integer, got {getattr(self, name)}")
        check(0 < self.val_fraction < 0.5, "val_fraction", f"must be in (0, 0.5), got {self.val_fraction}")
        check(self.img_size is None or self.img_size > 0, "img_size", f"must be positive, got {self.img_size}")
        check(0 < self.crop_min_area <= 1, "crop_min_area", f"must be in (0, 1], got {self.crop_min_area}")
        check(0 <= self.momentum < 1, "momentum", f"must be in [0, 1), got {self.momentum}")
        check(self.gpus_per_trial >= 0, "gpus_per_trial", f"must be >= 0, got {self.gpus_per_trial}")


def build_model(cfg: FinetuneConfig, num_classes: int):
    """The pre-trained backbone with a fresh zero-initialised head, at the fine-tuning resolution."""
    import vitcore

    if cfg.pretrained:
        model = vitcore.load_checkpoint(cfg.pretrained, **({"img_size": cfg.img_size} if cfg.img_size else {}))
    else:
        model = vitcore.create_model(cfg.variant, num_classes=num_classes, img_size=cfg.img_size or 224)
    return vitcore.reset_head(model, num_classes)


def finetune_trial(config: dict) -> None:
    """One learning rate: SGD fine-tuning, then val/test accuracy reported to Tune and MLflow."""
    import torch
    import torch.nn.functional as F
    from ray import tune
    from torch.utils.data import DataLoader

    import vitcore
    from pipelines.schema import ShardSet
    from common import tracking
    from training.data import ShardImageDataset, eval_transform, split_rows, train_transform
    from training.loop import autocast, effective_warmup, evaluate, lr_at, set_lr, update

    cfg = FinetuneConfig(**config["cfg"])
    lr = float(config["lr"])
    torch.set_num_threads(max(1, cfg.cpus_per_trial))
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if cfg.gpus_per_trial and torch.cuda.is_available() else "cpu")
    uri = config["mlflow_uri"]
    run_id = tracking.create_child_run(config["mlflow_parent"], f"lr={lr:g}", stage="finetune-trial",
                                       params={"lr": lr, **config["cfg"]}, uri=uri)
    try:
        train_set = ShardSet(cfg.train)
        num_classes = len(train_set.label_map)
        model = build_model(cfg, num_classes).to(device)
        img_size = model.config.img_size[0]
        train_rows, val_rows = split_rows(len(train_set), cfg.val_fraction, cfg.seed)
        train_ds = ShardImageDataset(train_set, train_transform(img_size, flip=cfg.flip, min_area=cfg.crop_min_area), rows=train_rows, seed=cfg.seed)
        val_ds = ShardImageDataset(train_set, eval_transform(img_size), rows=val_rows)
        test_ds = ShardImageDataset(cfg.test, eval_transform(img_size))
        gen = torch.Generator().manual_seed(cfg.seed)
        batch = min(cfg.batch_size, len(train_ds))
        train_loader = DataLoader(train_ds, batch_size=batch, shuffle=True, drop_last=True, generator=gen)
        val_loader = DataLoader(val_ds, batch_size=256)
        test_loader = DataLoader(test_ds, batch_size=256)

        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=0.0)
        warmup = effective_warmup(cfg.warmup_steps, cfg.steps)
        step, epoch, t0 = 0, 0, time.perf_counter()
        model.train()
        metrics: dict[str, float] = {}
        while step < cfg.steps:
            train_ds.set_epoch(epoch)
            for x, y in train_loader:
                x, y = x.to(device), y.to(device)
                set_lr(opt, lr_at(step, total=cfg.steps, warmup=warmup, peak=lr, schedule="cosine"))
                with autocast(device, cfg.bf16):
                    loss = F.cross_entropy(model(x).float(), y)
                update(loss, opt, model, cfg.grad_clip)
                step += 1
                last = step == cfg.steps
                if last or (cfg.eval_every and step % cfg.eval_every == 0):
                    val = evaluate(model, val_loader, device, cfg.bf16)
                    metrics = {"step": step, "train_loss": loss.item(), "val_loss": val["loss"],
                               "val_accuracy": val["accuracy"], "lr": lr}
                    if last:
                        test = evaluate(model, test_loader, device, cfg.bf16)
                        metrics.update(test_loss=test["loss"], test_accuracy=test["accuracy"],
                                       images_per_second=step * batch / (time.perf_counter() - t0))
                    tracking.log_metrics_to(run_id, metrics, step=step, uri=uri)
                    if last:
                        with tempfile.TemporaryDirectory() as d:
                            vitcore.save_checkpoint(model, Path(d) / MODEL_FILE)
                            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))
                    else:
                        tune.report(metrics)
                if last:
                    break
            epoch += 1
        tracking.end_run(run_id, uri=uri)
    except BaseException:
        tracking.end_run(run_id, failed=True, uri=uri)
        raise


def run_finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Run the learning-rate grid; returns one row per rate and the one selected on val accuracy."""
    from ray import tune

    from pipelines.schema import ShardSet
    from common import tracking
    from common.jobenv import durable_path
    from training.data import split_rows
    from training.ray_utils import init_ray

    resolved = {}
    for name in ("train", "test", "pretrained"):
        value = getattr(cfg, name)
        if value is None:
            continue
        path = Path(value).expanduser().resolve()
        if name == "pretrained" and path.is_dir():
            path = path / MODEL_FILE
        if name == "pretrained" and not path.is_file():
            raise ConfigError(f"pretrained: {path} does not exist; pass the {MODEL_FILE} that jobs/pretrain.py wrote")
        if name != "pretrained" and not (path / "manifest.json").is_file():
            raise ConfigError(f"{name}: {path} has no manifest.json; produce it with jobs/prepare.py --output {path}")
        resolved[name] = str(path)
    cfg = dataclasses.replace(cfg, **resolved)
    train_set, test_set = ShardSet(cfg.train), ShardSet(cfg.test)
    train_map, test_map = train_set.label_map, test_set.label_map
    if train_map != test_map:
        raise ConfigError(
            f"test: label map of {cfg.test} ({len(test_map)} labels) differs from train's ({len(train_map)}); "
            "prepare both splits with the same --label-map"
        )
    # Refused here rather than as a DataLoader error inside every trial.
    fit_rows, val_rows = split_rows(len(train_set), cfg.val_fraction, cfg.seed)
    if len(fit_rows) == 0 or len(val_rows) == 0:
        raise ConfigError(
            f"train: {cfg.train} has {len(train_set)} rows, too few to hold out {cfg.val_fraction:g} of them for "
            "choosing the learning rate and train on the rest; check its quarantine.jsonl or ingest more images"
        )
    if len(test_set) == 0:
        raise ConfigError(f"test: {cfg.test} has no rows; check its quarantine.jsonl or ingest more images")
    output = Path(durable_path(cfg.output, "output"))
    tracking.tracking_uri()  # refuses a store in Ray's uploaded copy before any trial runs
    output.mkdir(parents=True, exist_ok=True)
    init_ray(cfg.ray_address)

    uri = tracking.tracking_uri()
    with tracking.start_run("finetune", params=dataclasses.asdict(cfg), parent_run_id=cfg.parent_run_id) as run:
        resources = {"cpu": cfg.cpus_per_trial, **({"gpu": cfg.gpus_per_trial} if cfg.gpus_per_trial else {})}
        tuner = tune.Tuner(
            tune.with_resources(finetune_trial, resources),
            param_space={
                "lr": tune.grid_search(list(cfg.lrs)),
                "cfg": dataclasses.asdict(cfg),
                "mlflow_parent": run.info.run_id,
                "mlflow_uri": uri,
            },
            tune_config=tune.TuneConfig(
                metric="val_accuracy", mode="max", max_concurrent_trials=cfg.max_concurrent or None
            ),
            run_config=tune.RunConfig(name=f"finetune-{run.info.run_id[:8]}", storage_path=str(output / "ray"), verbose=0),
        )
        grid = tuner.fit()
        rows, failed = [], []
        for result in grid:
            lr = result.config["lr"]
            if result.error or not result.metrics or "test_accuracy" not in result.metrics:
                failed.append({"lr": lr, "error": str(result.error)})
                continue
            m = result.metrics
            rows.append({k: m[k] for k in ("lr", "train_loss", "val_accuracy", "test_accuracy")})
        if not rows:
            raise RuntimeError(f"every fine-tuning trial failed: {failed}")
        rows.sort(key=lambda r: r["lr"])
        best = grid.get_best_result(metric="val_accuracy", mode="max", filter_nan_and_inf=True)
        model_path = output / MODEL_FILE
        with best.checkpoint.as_directory() as d:
            shutil.copyfile(Path(d) / MODEL_FILE, model_path)
        summary = {
            "trials": rows,
            "failed": failed,
            "selected_lr": best.config["lr"],
            "selected_val_accuracy": best.metrics["val_accuracy"],
            "selected_test_accuracy": best.metrics["test_accuracy"],
            "model": str(model_path),
            "mlflow_run_id": run.info.run_id,
        }
        tracking.log_metrics({"selected_lr": summary["selected_lr"],
                              "val_accuracy": summary["selected_val_accuracy"],
                              "test_accuracy": summary["selected_test_accuracy"]})
        tracking.log_dict(summary, "finetune_summary.json")
        (output / "finetune_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
