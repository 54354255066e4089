"""Pre-training a vitcore ViT on Arrow shards with Ray Train (Section 4.1, "Training & Fine-tuning").

The paper pre-trains with Adam (β1=0.9, β2=0.999), weight decay 0.1, batch 4096, a linear
warm-up then linear decay, global-norm clipping at 1, and dropout 0.1 (Appendix B.1). Those
are the defaults here except batch size, which a single machine cannot hold.

One ``TorchTrainer`` runs :func:`train_loop_per_worker` on ``num_workers`` workers (gloo on CPU,
NCCL with ``use_gpu``). Each worker reads its own slice of the memory-mapped shards. Rank 0
logs step metrics into the MLflow run that the driver opened: Ray Train V2 rejects
``MLflowLoggerCallback``. Every epoch all workers report the same metrics and rank 0 attaches a
checkpoint, so a failed run resumes from its last epoch (``max_failures``), and re-running with
the same ``output`` and ``run_name`` continues where it stopped.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

from common.config import ConfigError, check

SCHEDULES = ("linear", "cosine")
MODEL_FILE = "model.safetensors"


@dataclasses.dataclass
class PretrainConfig:
    """Pre-train a Vision Transformer on Arrow shards with Ray Train."""

    data: str = field(metadata={"help": "shard directory written by jobs/prepare.py (holds manifest.json)"})
    output: str = field(default="pretrain_output", metadata={"help": "directory for the final model and Ray Train state"})
    variant: str = field(default="Ti/16", metadata={"help": "vitcore variant, e.g. Ti/16, S/16, B/16, R50+B/16"})
    img_size: int = field(default=224, metadata={"help": "training resolution in pixels"})
    depth: int | None = field(default=None, metadata={"help": "override the variant's number of blocks"})
    width: int | None = field(default=None, metadata={"help": "override the variant's hidden size"})
    mlp_dim: int | None = field(default=None, metadata={"help": "override the variant's MLP size"})
    num_heads: int | None = field(default=None, metadata={"help": "override the variant's attention heads"})
    objective: Literal["classification", "mpp"] = field(
        default="classification", metadata={"help": "supervised labels, or masked patch prediction (Appendix B.1.2)"}
    )
    loss: Literal["softmax", "sigmoid"] = field(
        default="softmax", metadata={"help": "softmax for one label per image, sigmoid for multi-label corpora"}
    )
    epochs: int = field(default=10, metadata={"help": "passes over the shards"})
    batch_size: int = field(default=256, metadata={"help": "global batch size, split across workers"})
    lr: float = field(default=1e-3, metadata={"help": "peak Adam learning rate"})
    weight_decay: float = field(default=0.1, metadata={"help": "decoupled weight decay (paper: 0.1)"})
    warmup_steps: int = field(default=10_000, metadata={"help": "linear warm-up steps; capped at 10% of training"})
    schedule: Literal["linear", "cosine"] = field(default="linear", metadata={"help": "decay after warm-up"})
    grad_clip: float = field(default=1.0, metadata={"help": "global gradient-norm clip; 0 disables"})
    dropout: float = field(default=0.1, metadata={"help": "dropout after dense layers (Appendix B.1)"})
    holdout: float = field(default=0.02, metadata={"help": "fraction of rows held out to measure accuracy"})
    loader: Literal["shards", "ray_data"] = field(
        default="shards",
        metadata={"help": "shards: each worker decodes its slice of the memory-mapped shards; "
                          "ray_data: Ray Data data tasks decode and augment on CPUs the workers leave free"},
    )
    loader_workers: int = field(default=0, metadata={"help": "torch DataLoader processes per worker (shards loader)"})
    num_workers: int = field(default=2, metadata={"help": "Ray Train workers"})
    cpus_per_worker: int = field(default=1, metadata={"help": "CPUs reserved per worker (and torch threads)"})
    use_gpu: bool = field(default=False, metadata={"help": "one GPU per worker, NCCL, bf16 autocast"})
    bf16: bool = field(default=True, metadata={"help": "bf16 autocast on GPU (ignored on CPU)"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model"})
    grad_checkpointing: bool = field(default=False, metadata={"help": "recompute block activations in backward"})
    max_failures: int = field(default=0, metadata={"help": "worker-group restarts from the last checkpoint"})
    log_every: int = field(default=10, metadata={"help": "rank-0 MLflow logging interval in steps"})
    seed: int = field(default=0, metadata={"help": "seed for init, shuffling and augmentation"})
    ray_address: str | None = field(default=None, metadata={"help": "Ray cluster address; default: RAY_ADDRESS or in-process"})
    run_name: str | None = field(default=None, metadata={"help": "Ray Train run name (same name resumes)"})
    parent_run_id: str | None = field(default=None, metadata={"help": "MLflow run to nest under"})

    def __post_init__(self) -> None:
        for name in ("img_size", "epochs", "batch_size", "num_workers", "cpus_per_worker", "log_every"):
            check(getattr(self, name) > 0, name, f"must be a positive integer, got {getattr(self, name)}")
        check(self.batch_size >= self.num_workers, "batch_size",
              f"must be at least num_workers ({self.num_workers}) so every worker gets a sample, got {self.batch_size}")
        check(self.lr > 0, "lr", f"must be positive, got {self.lr}")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout}")
        check(0 <= self.holdout < 0.5, "holdout", f"must be in [0, 0.5), got {self.holdout}")
        check(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        check(self.grad_clip >= 0, "grad_clip", f"must be >= 0, got {self.grad_clip}")
        check(self.loader_workers >= 0, "loader_workers", f"must be >= 0, got {self.loader_workers}")
        if self.objective == "mpp":
            check(self.loss == "softmax", "loss", "masked patch prediction uses a 512-way softmax; leave loss=softmax")


def model_options(cfg: Any) -> dict[str, Any]:
    """The vitcore ``create_model`` options a stage config asks for."""
    opts = {k: getattr(cfg, k) for k in ("depth", "width", "mlp_dim", "num_heads") if getattr(cfg, k, None) is not None}
    if getattr(cfg, "grad_checkpointing", False):
        opts["grad_checkpointing"] = True
    return opts


# Fields that may change between a run and its resumption: more epochs, or where it runs and logs.
RESUME_MAY_CHANGE = frozenset({"epochs", "max_failures", "log_every", "ray_address", "parent_run_id", "run_name",
                               "output", "data", "loader_workers"})


def check_resumable(saved: dict, current: dict) -> None:
    """Refuse to continue a checkpoint under a different recipe, which would silently mix two runs."""
    if not saved:  # written before checkpoints recorded their config
        return
    changed = sorted(k for k in set(saved) | set(current)
                     if k not in RESUME_MAY_CHANGE and saved.get(k) != current.get(k))
    if changed:
        diffs = ", ".join(f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in changed)
        raise ConfigError(
            f"run_name {current.get('run_name')!r}: cannot resume a run trained with a different config ({diffs}); "
            "use a new --run-name or --output to start fresh"
        )


def train_loop_per_worker(config: dict) -> None:
    """One Ray Train worker: build the model, stream its slice of the shards, train, report."""
    import numpy as np
    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler

    import vitcore
    from vitcore.variants import decode_variant
    from common import tracking
    from training.loop import (all_reduce_sum, autocast, classification_loss, effective_warmup, evaluate,
                                   lr_at, set_lr, unwrap, update)
    from training.data import ShardImageDataset, eval_transform, holdout_mask, normalize, shard_keys, train_transform

    cfg = PretrainConfig(**config["cfg"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, cfg.cpus_per_worker))
    torch.manual_seed(cfg.seed)
    device = ray.train.torch.get_device()

    full = ShardImageDataset(cfg.data, train_transform(cfg.img_size), label_mode="multi" if cfg.loss == "sigmoid" else "single", seed=cfg.seed)
    held_out = holdout_mask(shard_keys(full.shards), cfg.holdout)
    train_ds = ShardImageDataset(full.shards, full.transform, label_mode=full.label_mode, rows=np.flatnonzero(~held_out), seed=cfg.seed)
    held_ds = ShardImageDataset(full.shards, eval_transform(cfg.img_size), label_mode=full.label_mode, rows=np.flatnonzero(held_out), seed=cfg.seed)
    per_worker, steps_per_epoch = steps_per_epoch_or_error(cfg.data, len(train_ds), cfg.batch_size, world)
    if cfg.loader == "ray_data":
        stream = ray.train.get_dataset_shard("train")

        def epoch_batches(epoch: int):
            # Ray Train splits the stream equally across workers, so every worker takes the same
            # number of steps; the cap keeps DDP's collectives in lockstep regardless.
            batches = stream.iter_torch_batches(batch_size=per_worker, drop_last=True,
                                                local_shuffle_buffer_size=4 * per_worker)
            for step_in_epoch, batch in enumerate(batches):
                if step_in_epoch == steps_per_epoch:
                    break
                yield batch["image"], batch["label"]
    else:
        sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True)
        loader = DataLoader(train_ds, batch_size=per_worker, sampler=sampler, drop_last=True,
                            num_workers=cfg.loader_workers, pin_memory=device.type == "cuda")

        def epoch_batches(epoch: int):
            sampler.set_epoch(epoch)
            train_ds.set_epoch(epoch)
            yield from loader
    held_sampler = DistributedSampler(held_ds, num_replicas=world, rank=rank, shuffle=False) if len(held_ds) else None

    num_classes = full.num_classes
    mpp = cfg.objective == "mpp"
    # Pre-training head: one tanh hidden layer as wide as the model (Section 3.1).
    width = cfg.width or decode_variant(cfg.variant)["width"]
    model = vitcore.create_model(
        cfg.variant,
        # MPP predicts per-patch colours with its own head; the class head is not used.
        num_classes=0 if mpp else num_classes,
        img_size=cfg.img_size,
        representation_size=None if mpp else width,
        dropout=cfg.dropout,
        # i21k recipe (REFERENCE.md): head bias -10 so every sigmoid starts near zero.
        head_bias_init=-10.0 if cfg.loss == "sigmoid" else 0.0,
        **model_options(cfg),
    )
    trainable = vitcore.MaskedPatchPrediction(model) if mpp else model
    trainable = ray.train.torch.prepare_model(trainable)
    if cfg.compile:
        trainable = torch.compile(trainable)

    decay, no_decay = [], []
    for name, p in trainable.named_parameters():
        (no_decay if p.ndim < 2 or "pos_embed" in name or "cls_token" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.999),
    )
    total_steps = cfg.epochs * steps_per_epoch
    warmup = effective_warmup(cfg.warmup_steps, total_steps)

    start_epoch, step = 0, 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            state = torch.load(Path(d) / "train_state.pt", map_location=device, weights_only=False)
        check_resumable(state.get("cfg", {}), config["cfg"])
        unwrap(trainable).load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_epoch, step = state["epoch"] + 1, state["step"]

    run_id, uri = config["mlflow_run_id"], config["mlflow_uri"]
    for epoch in range(start_epoch, cfg.epochs):
        trainable.train()
        t0, seen, loss_sum, correct_sum = time.perf_counter(), 0, 0.0, 0.0
        for x, y in epoch_batches(epoch):
            # uint8 batches (Ray Data) cross to the device at a quarter of the bytes, then normalise there.
            x, y = normalize(x.to(device, non_blocking=True)), y.to(device, non_blocking=True)
            lr = lr_at(step, total=total_steps, warmup=warmup, peak=cfg.lr, schedule=cfg.schedule)
            set_lr(opt, lr)
            with autocast(device, cfg.bf16):
                if mpp:
                    # Appendix B.1.2: loss only on the corrupted patches; "accuracy" is per patch.
                    logits, targets, corrupted = trainable(x)
                    logits, targets = logits[corrupted].float(), targets[corrupted]
                    loss = F.cross_entropy(logits, targets)
                    correct = (logits.argmax(1) == targets).float().mean() * x.shape[0]
                else:
                    loss_sum_batch, correct = classification_loss(trainable(x), y)
                    loss = loss_sum_batch / x.shape[0]
            update(loss, opt, trainable, cfg.grad_clip)
            step += 1
            seen += x.shape[0]
            loss_sum += loss.item() * x.shape[0]
            correct_sum += float(correct)
            if rank == 0 and run_id and step % cfg.log_every == 0:
                tracking.log_metrics_to(run_id, {"train_loss": loss.item(), "lr": lr}, step=step, uri=uri)
        elapsed = time.perf_counter() - t0
        seen_all, loss_all, correct_all = all_reduce_sum([seen, loss_sum, correct_sum], device)
        metrics = {
            "epoch": epoch,
            "step": step,
            "train_loss": loss_all / max(1, seen_all),
            "train_accuracy": correct_all / max(1, seen_all),
            "images_per_second": seen_all / max(elapsed, 1e-9),
        }
        if held_sampler is not None and not mpp:
            scores = evaluate(trainable, DataLoader(held_ds, batch_size=per_worker, sampler=held_sampler), device, cfg.bf16)
            metrics.update(holdout_loss=scores["loss"], holdout_accuracy=scores["accuracy"])
        if rank == 0 and run_id:
            tracking.log_metrics_to(run_id, {k: v for k, v in metrics.items() if k != "step"}, step=step, uri=uri)
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if rank == 0:
                torch.save({"model": unwrap(trainable).state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                            "step": step, "cfg": config["cfg"]},
                           Path(d) / "train_state.pt")
                vitcore.save_checkpoint(model, Path(d) / MODEL_FILE)
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=checkpoint)


def ray_data_stream(cfg: PretrainConfig, shards):
    """The training stream for ``loader="ray_data"``: shard reads, then decode + augment as data tasks.

    Ray Data stalls when the training workers hold every CPU (REFERENCE.md), so refuse a layout
    that leaves none for the data tasks instead of hanging.
    """
    import ray

    from pipelines.ray_source import read_shards
    from training.data import DecodeBatch

    total = int(ray.cluster_resources().get("CPU", 0))
    reserved = cfg.num_workers * cfg.cpus_per_worker
    if reserved >= total:
        raise ConfigError(
            f"loader: ray_data needs CPUs for its data tasks, but the {cfg.num_workers} workers reserve "
            f"{reserved} of the cluster's {total} CPUs; lower num_workers or cpus_per_worker, or use loader=shards"
        )
    decode = DecodeBatch(cfg.img_size, label_mode="multi" if cfg.loss == "sigmoid" else "single",
                         num_classes=len(shards.label_map), holdout=cfg.holdout)
    columns = ["key", "image", "format", "height", "width", "labels"]
    return read_shards(cfg.data, columns=columns).map_batches(decode, batch_format="numpy", batch_size=64)


def steps_per_epoch_or_error(data: str, train_rows: int, batch_size: int, world: int) -> tuple[int, int]:
    """(batch per worker, steps per epoch), or a ConfigError when the rows cannot fill one step."""
    per_worker = max(1, batch_size // world)
    steps = train_rows // world // per_worker
    if steps == 0:
        raise ConfigError(
            f"data: {data}: {train_rows} training rows cannot fill one batch of {per_worker} per worker "
            f"on {world} workers; lower batch_size or num_workers, or ingest more images"
        )
    return per_worker, steps


def _config_error_from_workers(exc: BaseException) -> ConfigError | None:
    """A ConfigError raised on a worker (e.g. a refused resume), so the CLI reports it in one line."""
    failures = getattr(exc, "worker_failures", None) or {}
    for failure in failures.values():
        seen = failure
        while seen is not None:
            if isinstance(seen, ConfigError):
                return ConfigError(str(seen))
            seen = seen.__cause__ or getattr(seen, "cause", None)
    return None


def run_pretrain(cfg: PretrainConfig) -> dict[str, Any]:
    """Run pre-training end to end; returns the final metrics and the saved model's path."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipelines.schema import MANIFEST, ShardSet
    from common import tracking
    from common.fs import atomic_open, atomic_write, make_output_dir
    from training.data import holdout_mask, shard_keys
    from training.ray_utils import init_ray

    data = Path(cfg.data).expanduser()
    if not (data / MANIFEST).is_file():
        raise ConfigError(f"data: {data} has no {MANIFEST}; run jobs/prepare.py --output {data} first")
    shards = ShardSet(str(data))
    cfg = dataclasses.replace(cfg, data=str(data.resolve()))
    # Checked here too, before Ray starts, so the user gets one line instead of worker tracebacks.
    train_rows = int((~holdout_mask(shard_keys(shards), cfg.holdout)).sum())
    steps_per_epoch_or_error(str(data), train_rows, cfg.batch_size, cfg.num_workers)
    output = make_output_dir(cfg.output)
    init_ray(cfg.ray_address)

    datasets = {}
    if cfg.loader == "ray_data":
        datasets["train"] = ray_data_stream(cfg, shards)

    uri = tracking.tracking_uri()
    with tracking.start_run("pretrain", params=dataclasses.asdict(cfg), parent_run_id=cfg.parent_run_id,
                            run_name=cfg.run_name or "pretrain") as run:
        tracking.log_metrics({"num_rows": shards.num_rows, "num_classes": len(shards.label_map)})
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={
                "cfg": dataclasses.asdict(cfg),
                "mlflow_run_id": run.info.run_id,
                "mlflow_uri": uri,
            },
            datasets=datasets,
            scaling_config=ScalingConfig(
                num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                resources_per_worker={"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_gpu else {})},
            ),
            run_config=RunConfig(
                name=cfg.run_name or f"pretrain-{run.info.run_id[:8]}",
                storage_path=str(output / "ray"),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
                failure_config=FailureConfig(max_failures=cfg.max_failures),
            ),
        )
        try:
            result = trainer.fit()
        except Exception as exc:
            raise _config_error_from_workers(exc) or exc
        if result.error:
            raise _config_error_from_workers(result.error) or result.error
        model_path = output / MODEL_FILE
        with result.checkpoint.as_directory() as d, open(Path(d) / MODEL_FILE, "rb") as src, \
                atomic_open(model_path) as dst:
            shutil.copyfileobj(src, dst)
        metrics = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float))}
        summary = {"metrics": metrics, "model": str(model_path), "mlflow_run_id": run.info.run_id,
                   "label_map": shards.label_map, "objective": cfg.objective}
        atomic_write(output / "pretrain_summary.json", json.dumps(summary, indent=2))
        tracking.log_dict(summary, "pretrain_summary.json")
        tracking.log_artifact(model_path, "model")
    return summary
