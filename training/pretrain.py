"""Pre-training a vitcore ViT on Arrow shards with Ray Train (Section 4.1, "Training & Fine-tuning").

The paper pre-trains with Adam (β1=0.9, β2=0.999), weight decay 0.1, batch 4096, a linear
warm-up then linear decay, global-norm clipping at 1, and dropout 0.1 (Appendix B.1). Those
are the defaults here; ``configs/`` holds worked recipes.

One ``TorchTrainer`` runs :func:`train_loop_per_worker` on ``num_workers`` workers (gloo on CPU,
NCCL with ``use_gpu``), data-parallel with DDP or fully sharded with FSDP2. ``batch_size`` is the
global optimiser batch; each worker accumulates ``batch_size / (num_workers * microbatch)``
micro-batches per step. Rank 0 logs step metrics into the MLflow run that the driver opened
(Ray Train V2 rejects ``MLflowLoggerCallback``). Every ``checkpoint_every`` steps all workers
report and rank 0 attaches a checkpoint holding the model, the optimiser, the step, the data
position and the RNG states, so a worker group restarted after a failure (``max_failures``), or
the same ``run_name`` and ``output`` submitted again, continues without replaying or skipping a
batch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from common.config import ConfigError, check, free_on_resume
from common.progress import TTY_EVERY, ProgressLine, Ticker, eta_text, progress_every

SCHEDULES = ("linear", "cosine")
MODEL_FILE = "model.safetensors"
TRAIN_STATE = "train_state.pt"
STATE_FORMAT = "vitscale-pretrain/2"
DEFAULT_EPOCHS = 10


@dataclasses.dataclass
class PretrainConfig:
    """Pre-train a Vision Transformer on Arrow shards with Ray Train."""

    data: str = field(metadata={"recipe": False, "help": "shard directory written by jobs/prepare.py (holds manifest.json)"})
    output: str = field(default="pretrain_output", metadata={"recipe": False, "help": "directory for the final model, summary and (by default) Ray Train state"})
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
    epochs: int | None = field(default=None, metadata={"recipe": "length", "help": f"passes over the shards ({DEFAULT_EPOCHS} unless --steps is given)"})
    steps: int | None = field(default=None, metadata={"recipe": "length", "help": "training length in optimiser steps; when given, --epochs is ignored and the schedule follows the steps"})
    batch_size: int = field(default=4096, metadata={"help": "global optimiser batch (paper: 4096), split evenly across workers"})
    microbatch: int | None = field(default=None, metadata={"recipe": False, "help": "per-worker forward batch; each step accumulates batch_size/(num_workers*microbatch) of them (default: no accumulation)"})
    lr: float = field(default=1e-3, metadata={"help": "peak Adam learning rate"})
    weight_decay: float = field(default=0.1, metadata={"help": "decoupled weight decay (paper: 0.1)"})
    warmup_steps: int = field(default=10_000, metadata={"help": "linear warm-up steps; capped at 10% of training"})
    schedule: Literal["linear", "cosine"] = field(default="linear", metadata={"help": "decay after warm-up"})
    grad_clip: float = field(default=1.0, metadata={"help": "global gradient-norm clip; 0 disables"})
    dropout: float = field(default=0.1, metadata={"help": "dropout after dense layers (Appendix B.1)"})
    holdout: float = field(default=0.02, metadata={"help": "fraction of rows held out to measure accuracy"})
    loader: Literal["shards", "ray_data"] = field(
        default="shards",
        metadata={"recipe": False, "help": "shards: each worker decodes its slice of the memory-mapped shards; "
                          "ray_data: Ray Data data tasks decode and augment on CPUs the workers leave free"},
    )
    loader_workers: int | None = field(default=None, metadata={"recipe": False, "help": "torch DataLoader processes per worker (shards loader); default 0 on CPU, cpus_per_worker-1 (at least 2) with --use-gpu"})
    num_workers: int = field(default=2, metadata={"help": "Ray Train workers"})
    cpus_per_worker: int = field(default=1, metadata={"recipe": False, "help": "CPUs reserved per worker (and torch threads)"})
    use_gpu: bool = field(default=False, metadata={"help": "one GPU per worker, NCCL, bf16 autocast"})
    bf16: bool = field(default=True, metadata={"help": "bf16 autocast (FSDP: bf16 parameters) on GPU; ignored on CPU"})
    strategy: Literal["ddp", "fsdp"] = field(default="ddp", metadata={"recipe": False, "help": "ddp: replicated model; fsdp: FSDP2 full sharding (for L and H)"})
    compile: bool = field(default=False, metadata={"recipe": False, "help": "torch.compile the model"})
    grad_checkpointing: bool = field(default=False, metadata={"recipe": False, "help": "recompute block activations in backward"})
    stop_after: int | None = field(default=None, metadata={"recipe": False, "help": "end this submission after step N of the schedule, with a checkpoint there; submitting again continues (time-boxed allocations)"})
    checkpoint_every: int | None = field(default=None, metadata={"recipe": False, "help": "checkpoint every N steps (default: at the end of every epoch); always at the last step"})
    keep_checkpoints: int = field(default=2, metadata={"recipe": False, "help": "how many of the latest checkpoints to keep"})
    storage_path: str | None = field(default=None, metadata={"recipe": False, "help": "where Ray Train keeps checkpoints: a path or any pyarrow/fsspec URL (default OUTPUT/ray); shared by every node"})
    max_failures: int = field(default=0, metadata={"recipe": False, "help": "worker-group restarts from the last checkpoint"})
    log_every: int = field(default=10, metadata={"recipe": False, "help": "rank-0 MLflow logging interval in steps"})
    fewshot_every: int | None = field(default=None, metadata={"recipe": False, "help": "few-shot linear accuracy on --fewshot-data every N steps"})
    fewshot_data: str | None = field(default=None, metadata={"recipe": False, "help": "labelled shard set for the few-shot evaluator"})
    register_as: str | None = field(default=None, metadata={"recipe": False, "help": "register the final model under this name in the MLflow model registry"})
    seed: int = field(default=0, metadata={"help": "seed for init, shuffling and augmentation"})
    ray_address: str | None = field(default=None, metadata={"recipe": False, "help": "Ray cluster address; default: RAY_ADDRESS or in-process"})
    run_name: str | None = field(default=None, metadata={"recipe": False, "help": "Ray Train run name (same name resumes)"})
    parent_run_id: str | None = field(default=None, metadata={"recipe": False, "help": "MLflow run to nest under"})
    resources_per_worker: dict[str, float] | None = field(default=None, metadata={"recipe": False, "help": "extra Ray resources per worker as JSON, e.g. '{\"node_slot\": 1}' to place one worker per node"})

    def __post_init__(self) -> None:
        for name in ("img_size", "batch_size", "num_workers", "cpus_per_worker", "log_every", "keep_checkpoints"):
            check(getattr(self, name) > 0, name, f"must be a positive integer, got {getattr(self, name)}")
        for name in ("epochs", "steps", "microbatch", "checkpoint_every", "fewshot_every", "stop_after"):
            value = getattr(self, name)
            check(value is None or value > 0, name, f"must be a positive integer, got {value}")
        check(self.batch_size % self.num_workers == 0, "batch_size",
              f"the global batch {self.batch_size} does not split evenly over {self.num_workers} workers; "
              f"use a multiple of {self.num_workers}")
        per_worker = self.batch_size // self.num_workers
        check(self.microbatch is None or per_worker % self.microbatch == 0, "microbatch",
              f"{self.microbatch} does not divide the per-worker batch {per_worker} "
              f"(batch_size {self.batch_size} / {self.num_workers} workers); pick a divisor of {per_worker}")
        from vitcore.variants import decode_variant

        try:
            patch = decode_variant(self.variant)["patch_size"]
        except ValueError as exc:
            raise ConfigError(f"variant: {exc}") from None
        check(self.img_size % patch == 0, "img_size", f"{self.img_size} is not a multiple of the patch size {patch} "
              f"of {self.variant}; use e.g. {patch * max(1, round(self.img_size / patch))}")
        check(self.lr > 0, "lr", f"must be positive, got {self.lr}")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout}")
        check(0 <= self.holdout < 0.5, "holdout", f"must be in [0, 0.5), got {self.holdout}")
        check(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        check(self.grad_clip >= 0, "grad_clip", f"must be >= 0, got {self.grad_clip}")
        check(self.loader_workers is None or self.loader_workers >= 0, "loader_workers", f"must be >= 0, got {self.loader_workers}")
        check(self.max_failures >= -1, "max_failures", f"must be >= 0 (or -1: no limit), got {self.max_failures}")
        check((self.fewshot_every is None) == (self.fewshot_data is None), "fewshot_every",
              "--fewshot-every and --fewshot-data go together: give both or neither")
        if self.objective == "mpp":
            check(self.loss == "softmax", "loss", "masked patch prediction uses a 512-way softmax; leave loss=softmax")
            check(not (self.strategy == "fsdp" and self.fewshot_every), "fewshot_every",
                  "few-shot evaluation of an FSDP-sharded MPP backbone is not supported; use --strategy ddp")

    @property
    def microbatch_size(self) -> int:
        return self.microbatch or self.batch_size // self.num_workers

    @property
    def accumulation(self) -> int:
        return self.batch_size // self.num_workers // self.microbatch_size

    @property
    def dataloader_workers(self) -> int:
        # A GPU worker that decodes its own JPEGs starves; give it decoding processes by default.
        if self.loader_workers is not None:
            return self.loader_workers
        return max(2, self.cpus_per_worker - 1) if self.use_gpu else 0


def model_options(cfg: Any) -> dict[str, Any]:
    """The vitcore ``create_model`` options a stage config asks for."""
    opts = {k: getattr(cfg, k) for k in ("depth", "width", "mlp_dim", "num_heads") if getattr(cfg, k, None) is not None}
    if getattr(cfg, "grad_checkpointing", False):
        opts["grad_checkpointing"] = True
    return opts


def check_resumable(saved: dict, current: dict) -> None:
    """Refuse to continue a checkpoint under a different recipe, which would silently mix two runs."""
    if not saved:  # written before checkpoints recorded their config
        return
    changed = sorted(k for k in set(saved) | set(current)
                     if k not in free_on_resume(PretrainConfig) and saved.get(k) != current.get(k))
    if changed:
        diffs = ", ".join(f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in changed)
        raise ConfigError(
            f"run_name {current.get('run_name')!r}: cannot resume a run trained with a different config ({diffs}); "
            "use a new --run-name or --output to start fresh"
        )


def epoch_rows(n: int, world: int, rank: int, seed: int, epoch: int) -> np.ndarray:
    """Dataset positions that ``rank`` trains on in ``epoch``, in order: one seeded permutation per
    epoch, cut to a multiple of ``world`` and dealt round-robin (DistributedSampler's rule). A
    data position (epoch, steps done) therefore names exactly the rows already seen."""
    import torch

    g = torch.Generator()
    g.manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g).numpy()
    return perm[: n // world * world][rank::world]


def plan_steps(cfg: PretrainConfig, train_rows: int, world: int) -> tuple[int, int]:
    """(steps per epoch, total steps), or a ConfigError when the rows cannot fill one step."""
    _, steps_per_epoch = steps_per_epoch_or_error(cfg.data, train_rows, cfg.batch_size, world)
    total = cfg.steps or (cfg.epochs or DEFAULT_EPOCHS) * steps_per_epoch
    return steps_per_epoch, total


class _StartCounter:
    """Counts worker-group starts of one ``fit`` (a Ray actor): starts - 1 restarts."""

    def __init__(self) -> None:
        self.starts = 0

    def start(self) -> int:
        self.starts += 1
        return self.starts

    def count(self) -> int:
        return self.starts


def _gather(obj: Any) -> list:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def train_loop_per_worker(config: dict) -> None:
    """One Ray Train worker: build the model, stream its slice of the shards, train, report."""
    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.utils.data import DataLoader, DistributedSampler

    import vitcore
    from vitcore.variants import decode_variant
    from common import tracking
    from training.loop import (accumulate_step, all_reduce_sum, autocast, classification_loss, effective_warmup,
                               evaluate, lr_at, set_lr, unwrap)
    from training.data import ShardImageDataset, eval_transform, holdout_mask, normalize, shard_keys, train_transform

    cfg = PretrainConfig(**config["cfg"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, cfg.cpus_per_worker))
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    device = ray.train.torch.get_device()
    board = config.get("progress")
    if rank == 0 and config.get("starts") is not None:
        ray.get(config["starts"].start.remote())
    nodes = len(set(_gather(ray.get_runtime_context().get_node_id())))

    full = ShardImageDataset(cfg.data, train_transform(cfg.img_size), label_mode="multi" if cfg.loss == "sigmoid" else "single", seed=cfg.seed)
    held_out = holdout_mask(shard_keys(full.shards), cfg.holdout)
    train_ds = ShardImageDataset(full.shards, full.transform, label_mode=full.label_mode, rows=np.flatnonzero(~held_out), seed=cfg.seed)
    held_ds = ShardImageDataset(full.shards, eval_transform(cfg.img_size), label_mode=full.label_mode, rows=np.flatnonzero(held_out), seed=cfg.seed)
    per_worker = cfg.batch_size // world
    micro, accum = cfg.microbatch_size, cfg.accumulation
    steps_per_epoch, total_steps = plan_steps(cfg, len(train_ds), world)
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
    if cfg.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        trainable.to(device)
        shard_opts = {}
        if device.type == "cuda" and cfg.bf16:
            # bf16 parameters and activations, fp32 gradient reduction and optimiser state.
            shard_opts["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, **shard_opts)
        fully_shard(trainable, **shard_opts)
        dist_model = trainable
    else:
        dist_model = ray.train.torch.prepare_model(trainable)
    trainable = torch.compile(dist_model) if cfg.compile else dist_model
    # Dropout and MPP corruption differ between ranks; the initial weights above did not.
    torch.manual_seed(cfg.seed * 1_000_003 + 1 + rank)

    decay, no_decay = [], []
    for name, p in dist_model.named_parameters():
        (no_decay if p.ndim < 2 or "pos_embed" in name or "cls_token" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.999),
    )
    warmup = effective_warmup(cfg.warmup_steps, total_steps)
    end_step = min(total_steps, cfg.stop_after or total_steps)
    full_sd = StateDictOptions(full_state_dict=True, cpu_offload=True)

    step, epoch, offset = 0, 0, 0
    # Rows trained on in the current epoch (count, sum, sum of squares of row ids, over all ranks):
    # restored with the checkpoint, so a resume that replayed or skipped a batch would show.
    rows_seen = np.zeros(3, dtype=np.float64)
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            # Tensors and plain types only: nothing from storage is unpickled as code.
            state = torch.load(Path(d) / TRAIN_STATE, map_location="cpu", weights_only=True)
        check_resumable(state.get("cfg", {}), config["cfg"])
        if state.get("format") == STATE_FORMAT:
            set_model_state_dict(dist_model, state["model"], options=StateDictOptions(full_state_dict=True))
            set_optimizer_state_dict(dist_model, opt, state["optimizer"], options=StateDictOptions(full_state_dict=True))
            step, epoch, offset = int(state["step"]), int(state["epoch"]), int(state["offset"])
            if rank == 0:
                rows_seen = np.asarray(state["rows_seen"], dtype=np.float64)
            rng = state.get("rng", {})
            if len(rng.get("cpu", [])) == world:
                torch.set_rng_state(rng["cpu"][rank])
            if device.type == "cuda" and len(rng.get("cuda", [])) == world:
                torch.cuda.set_rng_state(rng["cuda"][rank], device)
        else:  # an epoch-level checkpoint from before step checkpoints
            unwrap(trainable).load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            step, epoch, offset = int(state["step"]), int(state["epoch"]) + 1, 0

    def own_generator():
        # A DataLoader iterator draws its base seed from the global RNG unless given its own;
        # that would make the dropout stream depend on where a run was resumed.
        return torch.Generator().manual_seed(cfg.seed)

    if cfg.loader == "ray_data":
        stream = ray.train.get_dataset_shard("train")

        def epoch_batches(epoch: int, offset: int):
            # A stream cannot seek: a resume skips the epoch's first `offset` steps of a fresh
            # shuffle. Ray Train splits the stream equally, so every worker takes the same steps.
            batches = stream.iter_torch_batches(batch_size=micro, drop_last=True,
                                                local_shuffle_buffer_size=4 * per_worker)
            for i, batch in enumerate(batches):
                if i == steps_per_epoch * accum:
                    break
                if i >= offset * accum:
                    yield batch["image"], batch["label"]

        def batch_rows(epoch: int, offset: int):
            return None
    else:
        def epoch_batches(epoch: int, offset: int):
            rows = epoch_rows(len(train_ds), world, rank, cfg.seed, epoch)[offset * per_worker: steps_per_epoch * per_worker]
            train_ds.set_epoch(epoch)
            yield from DataLoader(train_ds, batch_size=micro, sampler=rows.tolist(), drop_last=True,
                                  num_workers=cfg.dataloader_workers, pin_memory=device.type == "cuda",
                                  generator=own_generator())

        def batch_rows(epoch: int, offset: int):
            rows = epoch_rows(len(train_ds), world, rank, cfg.seed, epoch)[offset * per_worker:(offset + 1) * per_worker]
            return train_ds.rows[rows].astype(np.float64)

    fewshot = None
    if cfg.fewshot_every:
        fewshot = _fewshot_set(cfg)

    run_id, uri = config["mlflow_run_id"], config["mlflow_uri"]
    peak = None
    if device.type == "cuda":
        peak = vitcore.bf16_peak_flops(torch.cuda.get_device_name(device))
    flops_per_image = vitcore.train_flops_per_image(model)
    correct_box = [0.0]

    def loss_fn(batch):
        x, y = batch
        # uint8 batches (Ray Data) cross to the device at a quarter of the bytes, then normalise there.
        x, y = normalize(x.to(device, non_blocking=True)), y.to(device, non_blocking=True)
        with autocast(device, cfg.bf16):
            if mpp:
                # Appendix B.1.2: loss only on the corrupted patches; "accuracy" is per patch.
                logits, targets, corrupted = trainable(x)
                logits, targets = logits[corrupted].float(), targets[corrupted]
                correct_box[0] = correct_box[0] + (logits.argmax(1) == targets).float().mean().detach() * x.shape[0]
                return F.cross_entropy(logits, targets)
            loss_sum, correct = classification_loss(trainable(x), y)
        correct_box[0] = correct_box[0] + correct.detach()
        return loss_sum / x.shape[0]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def save_and_report(metrics: dict) -> None:
        model_sd = get_model_state_dict(dist_model, options=full_sd)
        optim_sd = get_optimizer_state_dict(dist_model, opt, options=full_sd)
        rng = {"cpu": _gather(torch.get_rng_state())}
        if device.type == "cuda":
            rng["cuda"] = [t.cpu() for t in _gather(torch.cuda.get_rng_state(device))]
        seen = all_reduce_sum(rows_seen.tolist(), device)
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if rank == 0:
                at_end = offset == steps_per_epoch
                torch.save({"format": STATE_FORMAT, "model": model_sd, "optimizer": optim_sd, "step": step,
                            "epoch": epoch + 1 if at_end else epoch, "offset": 0 if at_end else offset,
                            "rows_seen": [0.0, 0.0, 0.0] if at_end else seen, "rng": rng, "cfg": config["cfg"],
                            "world": world}, Path(d) / TRAIN_STATE)
                backbone = {k[len("backbone."):]: v for k, v in model_sd.items() if k.startswith("backbone.")} if mpp else model_sd
                plain = vitcore.VisionTransformer(model.config)
                plain.load_state_dict(backbone)
                vitcore.save_checkpoint(plain, Path(d) / MODEL_FILE)
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report({**metrics, "start_step": start_step, "nodes": nodes, "data_epoch": epoch, "data_offset": offset, "rows_seen": seen[0],
                              "rows_sum": seen[1], "rows_sumsq": seen[2]}, checkpoint=checkpoint)

    start_step = step
    trainable.train()
    sync()
    t_log, t_report = time.perf_counter(), time.perf_counter()
    log_images = log_loss = 0.0
    wait = [0.0]
    log_steps = 0
    rep_images = rep_loss = 0.0
    correct_box[0] = 0.0
    reported = False
    grad_norm = 0.0
    while step < end_step:
        if offset >= steps_per_epoch:
            epoch, offset, rows_seen = epoch + 1, 0, np.zeros(3, dtype=np.float64)
        batches = iter(epoch_batches(epoch, offset))

        def microbatches():
            for _ in range(accum):
                t = time.perf_counter()
                batch = next(batches)
                wait[0] += time.perf_counter() - t
                yield batch

        while offset < steps_per_epoch and step < end_step:
            lr = lr_at(step, total=total_steps, warmup=warmup, peak=cfg.lr, schedule=cfg.schedule)
            set_lr(opt, lr)
            loss, grad_norm = accumulate_step(trainable, opt, microbatches(), loss_fn, count=accum, grad_clip=cfg.grad_clip)
            rows = batch_rows(epoch, offset)
            if rows is not None:
                rows_seen += (len(rows), rows.sum(), (rows * rows).sum())
            step, offset = step + 1, offset + 1
            log_images += per_worker
            log_loss += loss
            log_steps += 1
            rep_images += per_worker
            rep_loss += loss * per_worker
            if step % cfg.log_every == 0:
                sync()
                elapsed = time.perf_counter() - t_log
                images_all, wait_all = all_reduce_sum([log_images, wait[0]], device)
                if rank == 0 and run_id:
                    metrics = {"train_loss": float(log_loss) / log_steps, "lr": lr, "grad_norm": float(grad_norm),
                               "images_per_second_per_worker": log_images / elapsed,
                               "images_per_second": images_all / elapsed,
                               "input_wait_fraction": wait_all / (world * elapsed)}
                    if peak:
                        # MFU: model FLOPs (vitcore's count, backward = 2x forward) over the bf16 peak.
                        metrics["mfu"] = log_images / elapsed * flops_per_image / peak
                    tracking.log_metrics_to(run_id, metrics, step=step, uri=uri)
                if rank == 0 and board is not None:
                    board.post.remote({"kind": "step", "time": time.time(), "step": step, "total": total_steps, "end": end_step,
                                       "loss": float(log_loss) / log_steps, "images_per_second": images_all / elapsed})
                log_images = log_loss = 0.0
                log_steps = 0
                wait[0] = 0.0
                t_log = time.perf_counter()
            if fewshot is not None and step % cfg.fewshot_every == 0:
                # Every rank runs the forward (FSDP's is collective); rank 0 logs.
                target = unwrap(trainable)
                scores = _fewshot_scores(target.backbone if mpp else target, fewshot, micro)
                if rank == 0 and run_id and scores:
                    tracking.log_metrics_to(run_id, scores, step=step, uri=uri)
                trainable.train()
            epoch_end = offset == steps_per_epoch
            due = (step % cfg.checkpoint_every == 0) if cfg.checkpoint_every else epoch_end
            held = {}
            if held_sampler is not None and not mpp and (epoch_end or step == end_step):
                scores = evaluate(trainable, DataLoader(held_ds, batch_size=micro, sampler=held_sampler,
                                                        generator=own_generator()), device, cfg.bf16)
                held = {"holdout_loss": scores["loss"], "holdout_accuracy": scores["accuracy"]}
                trainable.train()
                if rank == 0 and run_id and not (due or step == end_step):
                    tracking.log_metrics_to(run_id, held, step=step, uri=uri)
            if due or step == end_step:
                elapsed = time.perf_counter() - t_report
                seen_all, loss_all, correct_all = all_reduce_sum([rep_images, float(rep_loss), float(correct_box[0])], device)
                metrics = {"epoch": epoch, "step": step, "train_loss": loss_all / max(1, seen_all),
                           "train_accuracy": correct_all / max(1, seen_all),
                           "images_per_second": seen_all / max(elapsed, 1e-9), **held}
                if rank == 0 and run_id:
                    tracking.log_metrics_to(run_id, {k: v for k, v in metrics.items() if k != "step"}, step=step, uri=uri)
                if rank == 0 and board is not None:
                    board.post.remote({"kind": "report", "total": total_steps, **metrics})
                save_and_report(metrics)
                reported = True
                rep_images = rep_loss = correct_box[0] = 0.0
                t_report = time.perf_counter()
        del batches
    if not reported:  # resumed a finished run: hand the driver its checkpoint again
        save_and_report({"epoch": epoch if offset else max(0, epoch - 1), "step": step})


def _fewshot_set(cfg: PretrainConfig) -> dict:
    """Images and labels of ``fewshot_data`` (at most 2,000 rows), split in half for fit and test."""
    import torch

    from training.data import ShardImageDataset, eval_transform, split_rows

    ds = ShardImageDataset(cfg.fewshot_data, eval_transform(cfg.img_size))
    rows = np.random.default_rng(cfg.seed).permutation(len(ds))[:2000]
    xs, ys = zip(*(ds[int(i)] for i in rows))
    x, y = torch.stack(xs), np.asarray(ys)
    fit, test = split_rows(len(y), 0.5, cfg.seed)
    return {"x": x, "y": y, "fit": fit, "test": test, "num_classes": ds.num_classes}


def _fewshot_scores(model, fewshot: dict, batch_size: int) -> dict[str, float]:
    """Few-shot linear accuracy (vitcore's closed-form evaluator) for every shot count the
    fit half can fill: the paper's cheap way to follow pre-training (Section 4.1)."""
    import vitcore

    feats = vitcore.compute_representations(model, fewshot["x"], batch_size=batch_size)
    y, fit, test = fewshot["y"], fewshot["fit"], fewshot["test"]
    # Classes with no fit example cannot be learned from shots: evaluate on the others.
    classes = np.unique(y[fit])
    counts = np.bincount(np.searchsorted(classes, y[fit]), minlength=len(classes))
    shots = [k for k in (1, 5, 10, 25) if counts.min() >= k]
    test_keep = np.isin(y[test], classes)
    if len(classes) < 2 or not shots or not test_keep.any():
        return {}
    fit_y, test_y = np.searchsorted(classes, y[fit]), np.searchsorted(classes, y[test][test_keep])
    results = vitcore.fewshot_accuracy(feats[fit], fit_y, feats[test][test_keep], test_y,
                                       num_classes=len(classes), shots=shots, seeds=(0,))
    return {f"fewshot_{k}shot_accuracy": r["mean"] for k, r in results.items()}


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


def _storage(cfg: PretrainConfig, output: Path) -> tuple[str, Any]:
    """Ray Train's (storage_path, storage_filesystem): a local folder, or any pyarrow or fsspec URL."""
    from common.jobenv import durable_path, is_url

    if not cfg.storage_path:
        return str(output / "ray"), None
    if not is_url(cfg.storage_path):
        return str(Path(durable_path(cfg.storage_path, "storage_path")).expanduser().resolve()), None
    import pyarrow.fs

    try:
        fs, path = pyarrow.fs.FileSystem.from_uri(cfg.storage_path)
    except (pyarrow.ArrowInvalid, pyarrow.ArrowNotImplementedError):
        from common.fs import url_to_fs

        try:
            fsspec_fs, path = url_to_fs(cfg.storage_path)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"storage_path: {cfg.storage_path!r} is neither a pyarrow nor an fsspec URL ({exc}); "
                              "pass a path on shared storage or e.g. s3://bucket/runs") from None
        fs = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fsspec_fs))
    return path, fs


def _inspection_figures(model_path: Path, cfg: PretrainConfig, out_dir: Path) -> list[Path]:
    """vitcore's inspection figures of the trained model (Section 4.5): filter PCs, position-
    embedding similarity and mean attention distance, the last on a few training images."""
    import torch

    import vitcore
    from training.data import ShardImageDataset, eval_transform

    model = vitcore.load_checkpoint(model_path)
    figures = []
    if model.config.resnet_layers is None:
        vitcore.embedding_filter_pcs(model, path=out_dir / "embedding_filters.png")
        figures.append(out_dir / "embedding_filters.png")
    if model.config.posemb in ("learn", "sincos2d", "2d"):
        vitcore.position_embedding_similarity(model, path=out_dir / "position_embedding_similarity.png")
        figures.append(out_dir / "position_embedding_similarity.png")
    ds = ShardImageDataset(cfg.data, eval_transform(cfg.img_size))
    images = torch.stack([ds[i][0] for i in range(min(8, len(ds)))])
    vitcore.mean_attention_distance(model, images, path=out_dir / "mean_attention_distance.png")
    figures.append(out_dir / "mean_attention_distance.png")
    return figures


class StepProgress:
    """The driver's console lines from what rank 0 posts to a :class:`~training.ray_utils.ProgressBoard`.

    A status line per log interval (step out of total, the interval's mean loss, images per
    second over all workers, ETA at the pace since the first interval this run saw) and a
    permanent line per report (epoch end or checkpoint): what Ray Train's per-rank
    ``TrainingReport`` lines said, once.
    """

    def __init__(self, line: ProgressLine, board) -> None:
        self.line, self.board = line, board
        self._anchor: tuple[float, int] | None = None
        self._reported = -1  # the step of the last report shown

    def tick(self) -> None:
        import ray

        latest = None  # of the step rows since the last tick, only the newest is worth a line
        for row in ray.get(self.board.take.remote(), timeout=30):
            if row["kind"] == "step":
                latest = row
            else:
                self.show(row)
        if latest is not None and latest["step"] > self._reported:
            self.show(latest)

    def show(self, row: dict) -> None:
        if row["kind"] == "step":
            step, end = row["step"], row["end"]
            if self._anchor is None:
                self._anchor = (row["time"], step)
            t0, s0 = self._anchor
            self.line.update(f"step {step}/{row['total']} ({100 * step // max(1, row['total'])}%), "
                             f"loss {row['loss']:.4f}, {row['images_per_second']:.1f} img/s"
                             + eta_text(step - s0, end - s0, row["time"] - t0))
        else:
            self._reported = row["step"]
            held = (f", held-out loss {row['holdout_loss']:.4f} accuracy {row['holdout_accuracy']:.3f}"
                    if "holdout_accuracy" in row else "")
            self.line.above(f"epoch {row['epoch']} to step {row['step']}/{row['total']}: train loss "
                            f"{row['train_loss']:.4f} accuracy {row['train_accuracy']:.3f}{held}; "
                            f"{row['images_per_second']:.1f} img/s, checkpoint saved")

    def finish(self) -> None:
        try:
            self.tick()
        except Exception:  # noqa: BLE001 - the run's own error, if any, is the one to show
            pass
        self.line.close()


def run_pretrain(cfg: PretrainConfig) -> dict[str, Any]:
    """Run pre-training end to end; returns the final metrics, the saved model's path, the steps
    trained and the worker-group restarts."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from training.loopback_torch import LoopbackTorchConfig

    from common import tracking
    from common.fs import atomic_open, atomic_write, make_output_dir
    from common.jobenv import durable_path
    from pipelines.schema import MANIFEST, ShardSet, file_sha256
    from training.data import holdout_mask, shard_keys
    from training.ray_utils import ProgressBoard, check_resume_snapshot, init_ray

    data = Path(cfg.data).expanduser()
    if not (data / MANIFEST).is_file():
        raise ConfigError(f"data: {data} has no {MANIFEST}; run jobs/prepare.py --output {data} first")
    if cfg.fewshot_data and not (Path(cfg.fewshot_data).expanduser() / MANIFEST).is_file():
        raise ConfigError(f"fewshot_data: {cfg.fewshot_data} has no {MANIFEST}; prepare a labelled shard set "
                          "with jobs/prepare.py and pass its directory")
    shards = ShardSet(str(data))
    cfg = dataclasses.replace(cfg, data=str(data.resolve()),
                              fewshot_data=str(Path(cfg.fewshot_data).expanduser().resolve()) if cfg.fewshot_data else None)
    # Checked here, before Ray starts, so the user gets one line instead of worker tracebacks.
    output = Path(durable_path(cfg.output, "output")).expanduser().resolve()
    uri = tracking.tracking_uri()
    train_rows = int((~holdout_mask(shard_keys(shards), cfg.holdout)).sum())
    steps_per_epoch, total_steps = plan_steps(cfg, train_rows, cfg.num_workers)
    cfg = dataclasses.replace(cfg, output=str(output))
    storage_path, storage_fs = _storage(cfg, output)
    check_resume_snapshot(storage_path, cfg.run_name, storage_fs)
    output = make_output_dir(output)
    init_ray(cfg.ray_address)

    datasets = {}
    if cfg.loader == "ray_data":
        datasets["train"] = ray_data_stream(cfg, shards)

    starts = ray.remote(num_cpus=0)(_StartCounter).remote()
    board = ray.remote(num_cpus=0)(ProgressBoard).remote()
    from pipelines.schema import shard_set_record

    data_record = shard_set_record(cfg.data, role="training")
    records = [data_record] + ([shard_set_record(cfg.fewshot_data, role="evaluation")] if cfg.fewshot_data else [])
    config = dataclasses.asdict(cfg)
    name = f"pretrain {cfg.variant.replace('/', '')} on {data_record['name']}"
    with tracking.start_run("pretrain", params=config, parent_run_id=cfg.parent_run_id,
                            run_name=name + (f" ({cfg.run_name})" if cfg.run_name else ""),
                            tags=tracking.run_tags(cfg, data=records, main=[data_record]),
                            log_system_metrics=True) as run:
        tracking.log_shard_inputs(records)
        tracking.log_metrics({"num_rows": shards.num_rows, "num_classes": len(shards.label_map),
                              "planned_steps": total_steps, "steps_per_epoch": steps_per_epoch,
                              "accumulation": cfg.accumulation})
        resources = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_gpu else {}), **(cfg.resources_per_worker or {})}
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={
                "cfg": dataclasses.asdict(cfg),
                "mlflow_run_id": run.info.run_id,
                "mlflow_uri": uri,
                "starts": starts,
                "progress": board,
            },
            datasets=datasets,
            torch_config=LoopbackTorchConfig(),
            scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                         resources_per_worker=resources),
            run_config=RunConfig(
                name=cfg.run_name or f"pretrain-{run.info.run_id[:8]}",
                storage_path=storage_path,
                storage_filesystem=storage_fs,
                checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
                failure_config=FailureConfig(max_failures=cfg.max_failures),
            ),
        )
        shown = StepProgress(ProgressLine("pretrain"), board)
        try:
            # Poll at least as often as lines are due: a short run's steps must not all fall
            # between two polls (only the newest step of each poll gets a line).
            every = progress_every()
            with Ticker(shown.tick, max(0.05, min(TTY_EVERY, every) if every > 0 else TTY_EVERY)):
                result = trainer.fit()
        except Exception as exc:
            raise _config_error_from_workers(exc) or exc
        finally:
            shown.finish()
            ray.kill(board)
        if result.error:
            raise _config_error_from_workers(result.error) or result.error
        restarts = max(0, ray.get(starts.count.remote()) - 1)
        ray.kill(starts)
        model_path = output / MODEL_FILE
        with result.checkpoint.as_directory() as d, open(Path(d) / MODEL_FILE, "rb") as src, \
                atomic_open(model_path) as dst:
            shutil.copyfileobj(src, dst)
        metrics = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float))}
        steps = int(metrics.get("step", 0))
        summary = {"metrics": metrics, "model": str(model_path), "mlflow_run_id": run.info.run_id,
                   "label_map": shards.label_map, "objective": cfg.objective, "steps": steps,
                   "planned_steps": total_steps, "restarts": restarts, "checkpoint": result.checkpoint.path,
                   "data_position": {"epoch": int(metrics.get("data_epoch", 0)),
                                     "offset": int(metrics.get("data_offset", 0)),
                                     "rows_seen_in_epoch": int(metrics.get("rows_seen", 0)),
                                     "rows_sum": int(metrics.get("rows_sum", 0)),
                                     "rows_sumsq": int(metrics.get("rows_sumsq", 0))},
                   "resumed_from_step": int(metrics.get("start_step", 0)), "nodes": int(metrics.get("nodes", 1))}
        tracking.log_metrics({"restarts": restarts, "steps": steps})
        tracking.log_dict(summary, "pretrain_summary.json")
        figures = _inspection_figures(model_path, cfg, output / "inspection")
        for fig in figures:
            tracking.log_artifact(fig, "inspection")
        summary["inspection"] = [str(f) for f in figures]
        from training import run_artifacts

        curves = run_artifacts.pretrain_curves(
            tracking.metric_history(run.info.run_id, ["train_loss", "holdout_loss", "lr", "images_per_second",
                                                      "train_accuracy", "holdout_accuracy",
                                                      *[k for k in tracking.get_run(run.info.run_id).data.metrics
                                                        if k.startswith("fewshot_")]]),
            output / run_artifacts.PRETRAIN_CURVES, title=name)
        if curves is not None:
            tracking.log_artifact(curves, "plots")
        # Beside the model, for the stages that read it: this run and its lineage.
        tracking.write_lineage(output, run, "pretrain")
        info = run_artifacts.log_vit_model(model_path, labels=shards.label_names,
                                           metadata={"vitscale.pretrain_run_id": run.info.run_id,
                                                     "vitscale.objective": cfg.objective})
        summary["mlflow_model_uri"] = info.model_uri
        if cfg.register_as:
            import vitcore

            config = vitcore.read_checkpoint(model_path)[0].to_dict()
            summary["registered"] = tracking.register_model(
                cfg.register_as, info.model_uri,
                tags={"vitscale.model_config": json.dumps(config),
                      "vitscale.data_manifest_sha256": file_sha256(data / MANIFEST),
                      "vitscale.data": cfg.data, "vitscale.pretrain_run_id": run.info.run_id})
        atomic_write(output / "pretrain_summary.json", json.dumps(summary, indent=2))
    return summary
