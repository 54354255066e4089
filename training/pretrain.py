"""Pre-training a vitcore ViT on Arrow shards with Ray Train (Section 4.1, "Training & Fine-tuning").

The paper pre-trains with Adam (β1=0.9, β2=0.999), weight decay 0.1, batch 4096, a linear
warm-up then linear decay, global-norm clipping at 1, and dropout 0.1 (Appendix B.1). Those
are the defaults here; ``configs/`` holds worked recipes.

One ``TorchTrainer`` runs :func:`train_loop_per_worker`, a :class:`training.trainer.Trainer`, on
``num_workers`` workers (gloo on CPU, NCCL with ``use_gpu``), data-parallel with DDP or fully
sharded with FSDP2. ``batch_size`` is the global optimiser batch; each worker accumulates
``batch_size / (num_workers * microbatch)`` micro-batches per step. Rank 0 logs into the MLflow
run that the driver opened (:mod:`training.metrics`). The step checkpoints of
:mod:`training.checkpointer` let a worker group restarted after a failure (``max_failures``), or
the same ``run_name`` and ``output`` submitted again, continue without replaying or skipping a
batch. This module holds the config and the driver.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import posixpath
import secrets
import shutil
import signal
import sys
import threading
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

import pyarrow.fs

from common import tracking
from common.cli import Interrupted, interrupts
from common.config import ConfigError, check
from common.disk import DiskFull, disk_line
from common.fs import atomic_write, make_output_dir, url_to_fs
from common.jobenv import durable_path, is_url
from common.locks import FolderLock, check_owner, check_same_data, claim_folder, reading
from common.progress import TTY_EVERY, ProgressLine, StepProgress, Ticker, progress_every
from common.tracking_queue import SPOOL_DIR
from pipelines.schema import MANIFEST, ShardSet, file_sha256, missing_manifest_hint, shard_set_record
from training import run_artifacts
from training.task_folders import SPLITS, check_task_folders, task_folders, task_records

DEFAULT_EPOCHS = 10
DEFAULT_DROPOUT = 0.1
SUMMARY = "pretrain_summary.json"
# The run that --output holds, written before Ray starts: a re-run without --run-name resumes it.
RUN_RECORD = "pretrain_run.json"


@dataclasses.dataclass
class PretrainConfig:
    """Pre-train a Vision Transformer on Arrow shards with Ray Train."""

    data: str = field(metadata={"recipe": False, "help": "shard directory written by jobs/prepare.py (holds manifest.json)"})
    output: str = field(default="pretrain_output", metadata={"recipe": False, "help": "directory for the final model, summary and (by default) Ray Train state"})
    variant: str = field(default="Ti/16", metadata={"help": "vitcore variant, e.g. Ti/16, S/16, B/16, R50+B/16, or a BiT ResNet, e.g. BiT-R50x1"})
    img_size: int = field(default=224, metadata={"help": "training resolution in pixels"})
    depth: int | None = field(default=None, metadata={"help": "override the variant's number of blocks"})
    width: int | None = field(default=None, metadata={"help": "override the variant's hidden size"})
    mlp_dim: int | None = field(default=None, metadata={"help": "override the variant's MLP size"})
    num_heads: int | None = field(default=None, metadata={"help": "override the variant's attention heads"})
    classifier: Literal["token", "gap"] = field(default="token", metadata={"off": "token", "help": "token: the [class] token feeds the head (Eq. 4); gap: global average pooling of the encoded patches (big_vision's plain S/16 baseline)"})
    posemb: Literal["learn", "sincos2d"] = field(default="learn", metadata={"off": "learn", "help": "learn: learned 1D position embeddings (the paper); sincos2d: fixed 2D sin-cos embeddings (big_vision's plain S/16 baseline)"})
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
    dropout: float = field(default=DEFAULT_DROPOUT, metadata={"help": "dropout after dense layers (Appendix B.1); a BiT ResNet has none"})
    label_smoothing: float = field(default=0.0, metadata={"off": 0.0, "help": "softmax label smoothing ε: each target becomes (1-ε) one-hot + ε/classes (Section 4.3; DeiT: 0.1)"})
    drop_path: float = field(default=0.0, metadata={"off": 0.0, "help": "stochastic depth: a block's residual branches are dropped per image at a rate rising linearly over depth from 0 to this (ViTs only; AugReg, DeiT: 0.1)"})
    mixup: float = field(default=0.0, metadata={"off": 0.0, "help": "Mixup α: blend each batch with itself reversed, images and targets, λ ~ Beta(α, α); 0 is off (DeiT: 0.8, big_vision S/16: 0.2)"})
    cutmix: float = field(default=0.0, metadata={"off": 0.0, "help": "CutMix α: paste a box of the partner image covering about 1-λ of each image, λ ~ Beta(α, α); 0 is off (DeiT: 1.0)"})
    ema_decay: float = field(default=0.0, metadata={"off": 0.0, "help": "keep an exponential moving average of the weights with this decay (e.g. 0.9999; DeiT: 0.99996); the few-shot scores and the saved model use it; 0 is off"})
    randaug: list[int] | None = field(default=None, metadata={"off": None, "help": "RandAugment N,M as big_vision runs it: N ops per image, each one of 16 picked uniformly, at magnitude M (0-30; above 10 extrapolates), after the crop and flip; off by default (big_vision S/16: 2,10; AugReg medium2: 2,15; DeiT: 2,9)"})
    mixup_switch_prob: float | None = field(default=None, metadata={"off": None, "help": "with both --mixup and --cutmix, the chance that a batch takes CutMix (default 0.5, as timm)"})
    holdout: float = field(default=0.02, metadata={"help": "fraction of rows held out to measure accuracy"})
    fraction: float = field(default=1.0, metadata={"off": 1.0, "help": "train on the nested subset of this fraction of the rows not held out, picked by a hash of each row's key: a smaller fraction's rows lie inside a larger one's (1: every row)"})
    loader: Literal["shards", "ray_data"] = field(
        default="shards",
        metadata={"recipe": False, "help": "shards: each worker decodes its slice of the memory-mapped shards; "
                          "ray_data: Ray Data data tasks decode and augment on CPUs the workers leave free"},
    )
    augment: Literal["auto", "device", "item"] = field(
        default="auto",
        metadata={"recipe": False, "help": "where the Inception crop is resized, flipped and normalised: device: the CPU "
                          "decodes and copies each crop, the worker's device resizes the batch; item: the CPU makes "
                          "each image model-ready; auto: device with --use-gpu, item without"},
    )
    loader_workers: int | None = field(default=None, metadata={"recipe": False, "help": "torch DataLoader processes per worker (shards loader); default 0 on CPU, cpus_per_worker-1 (at least 2) with --use-gpu"})
    num_workers: int = field(default=2, metadata={"help": "Ray Train workers"})
    cpus_per_worker: int = field(default=1, metadata={"recipe": False, "help": "CPUs reserved per worker (and torch threads)"})
    use_gpu: bool = field(default=False, metadata={"help": "one GPU per worker, NCCL, bf16 autocast"})
    bf16: bool = field(default=True, metadata={"help": "bf16 autocast (FSDP: bf16 parameters) on GPU; ignored on CPU"})
    strategy: Literal["ddp", "fsdp"] = field(default="ddp", metadata={"recipe": False, "help": "ddp: replicated model; fsdp: FSDP2 full sharding (for L and H)"})
    compile: Literal["auto", "eager", "default", "reduce-overhead", "max-autotune"] = field(default="auto", metadata={"recipe": False, "help": "eager: no torch.compile; default, reduce-overhead (CUDA graphs), max-autotune: torch.compile modes; auto: default with --use-gpu, eager without"})
    fused_adamw: bool = field(default=False, metadata={"recipe": False, "help": "AdamW's fused kernel (torch.optim.AdamW(fused=True)); off until measured faster on a GPU"})
    grad_checkpointing: bool = field(default=False, metadata={"recipe": False, "help": "recompute block activations in backward"})
    stop_after: int | None = field(default=None, metadata={"recipe": False, "help": "end this submission after step N of the schedule, with a checkpoint there; submitting again continues (time-boxed allocations)"})
    checkpoint_every: int | None = field(default=None, metadata={"recipe": False, "help": "checkpoint every N steps (default: at the end of every epoch); always at the last step"})
    keep_checkpoints: int = field(default=2, metadata={"recipe": False, "help": "how many of the latest checkpoints to keep"})
    storage_path: str | None = field(default=None, metadata={"recipe": False, "help": "where Ray Train keeps checkpoints: a path or any pyarrow/fsspec URL (default OUTPUT/ray); shared by every node"})
    max_failures: int = field(default=0, metadata={"recipe": False, "help": "worker-group restarts from the last checkpoint"})
    log_every: int = field(default=10, metadata={"recipe": False, "help": "rank-0 MLflow logging interval in steps"})
    fewshot_every: int | None = field(default=None, metadata={"recipe": False, "help": "few-shot linear accuracy on --fewshot-data and each --fewshot-task folder every N steps"})
    fewshot_data: str | None = field(default=None, metadata={"recipe": False, "help": "labelled shard set for the few-shot evaluator"})
    fewshot_task: list[str] = field(default_factory=list, metadata={"recipe": False, "help": "NAME=DIR, repeatable: a downstream task folder (train800/, val200/, test/, as jobs/fewshot.py --task reads it) few-shot scored every --fewshot-every steps: fit on train800 and val200, scored on test (at most 2,000 rows of each)"})
    fewshot_shots: list[int] | None = field(default=None, metadata={"recipe": False, "help": "shot counts of the few-shot scoring during training; default: 1, 5, 10 and 25, those every class can fill"})
    register_as: str | None = field(default=None, metadata={"recipe": False, "help": "register the final model under this name in the MLflow model registry"})
    seed: int = field(default=0, metadata={"help": "seed for init, shuffling and augmentation"})
    ray_address: str | None = field(default=None, metadata={"recipe": False, "help": "Ray cluster address; default: RAY_ADDRESS or in-process"})
    run_name: str | None = field(default=None, metadata={"recipe": False, "help": "Ray Train run name; default: the run "
                                                                                "already in --output (which resumes), else a new one"})
    overwrite: bool = field(default=False, metadata={"recipe": False, "help": "start again over the run in --output "
                                                                            "(its checkpoints and outputs go) instead of resuming it"})
    data_changed_ok: bool = field(default=False, metadata={"recipe": False, "help": "resume the run in --output even "
                                                                                  "though a shard set it reads was replaced since it started"})
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
        self._check_regularizers()  # first: a knob a BiT ResNet lacks is named before its variant is decoded
        from vitcore.variants import is_bit_variant

        if is_bit_variant(self.variant):
            self._check_resnet()
        else:
            self._check_vit()
        check(self.lr > 0, "lr", f"must be positive, got {self.lr}")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout}")
        check(0 <= self.holdout < 0.5, "holdout", f"must be in [0, 0.5), got {self.holdout}")
        check(0 < self.fraction <= 1, "fraction", f"must be in (0, 1] (1: every row), got {self.fraction}")
        check(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        check(self.grad_clip >= 0, "grad_clip", f"must be >= 0, got {self.grad_clip}")
        check(self.loader_workers is None or self.loader_workers >= 0, "loader_workers", f"must be >= 0, got {self.loader_workers}")
        check(self.max_failures >= -1, "max_failures", f"must be >= 0 (or -1: no limit), got {self.max_failures}")
        scored = bool(self.fewshot_data or self.fewshot_task)
        check((self.fewshot_every is None) != scored, "fewshot_every", "--fewshot-every and --fewshot-data or "
              "--fewshot-task go together: give --fewshot-every with at least one of them, or none")
        check(self.fewshot_shots is None or (bool(self.fewshot_shots) and min(self.fewshot_shots) > 0), "fewshot_shots",
              f"must be positive shot counts, e.g. --fewshot-shots 5,10; got {self.fewshot_shots}")
        task_folders(self.fewshot_task, "fewshot_task")
        if self.objective == "mpp":
            check(self.loss == "softmax", "loss", "masked patch prediction uses a 512-way softmax; leave loss=softmax")
            check(not (self.strategy == "fsdp" and self.fewshot_every), "fewshot_every",
                  "few-shot evaluation of an FSDP-sharded MPP backbone is not supported; use --strategy ddp")

    def _check_vit(self) -> None:
        from vitcore.variants import decode_variant

        try:
            patch = decode_variant(self.variant)["patch_size"]
        except ValueError as exc:
            raise ConfigError(f"variant: {exc}") from None
        check(self.img_size % patch == 0, "img_size", f"{self.img_size} is not a multiple of the patch size {patch} "
              f"of {self.variant}; use e.g. {patch * max(1, round(self.img_size / patch))}")

    def _check_resnet(self) -> None:
        """A BiT ResNet (the paper's baseline): none of a ViT's knobs. Its pre-training head is one
        dense layer on the pooled features, as BiT's; the ViT default dropout becomes none."""
        from vitcore.variants import decode_bit_variant

        try:
            decode_bit_variant(self.variant)
        except ValueError as exc:
            raise ConfigError(f"variant: {exc}") from None
        for name in ("depth", "width", "mlp_dim", "num_heads"):
            check(getattr(self, name) is None, name, f"sets a ViT's {name}; {self.variant} is a BiT ResNet, whose "
                  f"size is in its name (e.g. BiT-R50x1): drop --{name.replace('_', '-')}")
        for name, default in (("classifier", "token"), ("posemb", "learn")):
            check(getattr(self, name) == default, name, f"sets a ViT's {name}; {self.variant} is a BiT ResNet, which "
                  f"pools by global average and has no position embeddings: drop --{name}")
        if self.dropout == DEFAULT_DROPOUT:
            self.dropout = 0.0
        check(self.dropout == 0, "dropout", f"{self.variant} is a BiT ResNet, which has no dropout; leave out --dropout")
        check(self.objective == "classification", "objective", f"masked patch prediction needs patches; "
              f"{self.variant} is a BiT ResNet: use --objective classification or a ViT --variant")
        check(self.strategy == "ddp", "strategy", f"FSDP here shards a ViT's blocks; train {self.variant} with "
              "--strategy ddp")

    def _check_regularizers(self) -> None:
        from training.randaugment import MAX_MAGNITUDE
        from vitcore.variants import is_bit_variant

        check(0 <= self.label_smoothing < 1, "label_smoothing", f"must be in [0, 1), got {self.label_smoothing}")
        check(not self.label_smoothing or (self.loss == "softmax" and self.objective == "classification"),
              "label_smoothing", "applies to the softmax classification loss; use --loss softmax or leave it at 0")
        check(0 <= self.drop_path < 1, "drop_path", f"must be in [0, 1), got {self.drop_path}")
        for name in ("mixup", "cutmix"):
            check(getattr(self, name) >= 0, name, f"must be >= 0 (0 is off), got {getattr(self, name)}")
            check(not getattr(self, name) or self.objective == "classification", name,
                  "mixes class targets; leave it at 0 with --objective mpp")
        check(0 <= self.ema_decay < 1, "ema_decay", f"must be in [0, 1) (0 is off), got {self.ema_decay}")
        check(not (self.ema_decay and self.strategy == "fsdp"), "ema_decay",
              "an averaged copy of an FSDP-sharded model is not supported; use --strategy ddp or leave it at 0")
        check(self.randaug is None or (len(self.randaug) == 2 and self.randaug[0] >= 1
                                        and 0 <= self.randaug[1] <= MAX_MAGNITUDE), "randaug",
              f"expected N,M with N >= 1 layers and a magnitude M from 0 to {MAX_MAGNITUDE}, got "
              f"{','.join(map(str, self.randaug or []))}; e.g. --randaug 2,10, or leave --randaug out")
        switch = self.mixup_switch_prob
        check(switch is None or (self.mixup > 0 and self.cutmix > 0), "mixup_switch_prob",
              "picks between Mixup and CutMix; give both --mixup and --cutmix, or leave it out")
        check(switch is None or 0 <= switch <= 1, "mixup_switch_prob", f"must be in [0, 1], got {switch}")
        check(not (self.drop_path and is_bit_variant(self.variant)), "drop_path",
              f"{self.variant} is a BiT ResNet, which has no stochastic depth; leave --drop-path at 0 or use a ViT")

    @property
    def microbatch_size(self) -> int:
        return self.microbatch or self.batch_size // self.num_workers

    @property
    def accumulation(self) -> int:
        return self.batch_size // self.num_workers // self.microbatch_size

    @property
    def device_augment(self) -> bool:
        return self.augment == "device" or (self.augment == "auto" and self.use_gpu)

    @property
    def dataloader_workers(self) -> int:
        # A GPU worker that decodes its own JPEGs starves; give it decoding processes by default.
        if self.loader_workers is not None:
            return self.loader_workers
        return max(2, self.cpus_per_worker - 1) if self.use_gpu else 0

    def plan_steps(self, train_rows: int, world: int) -> tuple[int, int]:
        """(steps per epoch, total steps), or a ConfigError when the rows cannot fill one step."""
        per_worker = max(1, self.batch_size // world)
        steps_per_epoch = train_rows // world // per_worker
        if steps_per_epoch == 0:
            raise ConfigError(
                f"data: {self.data}: {train_rows} training rows cannot fill one batch of {per_worker} per worker "
                f"on {world} workers; lower batch_size or num_workers, or ingest more images"
            )
        return steps_per_epoch, self.steps or (self.epochs or DEFAULT_EPOCHS) * steps_per_epoch


def train_loop_per_worker(config: dict) -> None:
    """One Ray Train worker: build the trainer from the driver's config, train, report."""
    from training.trainer import Trainer

    trainer = Trainer(PretrainConfig(**config["cfg"]), config).build()
    try:
        trainer.train()
    finally:
        trainer.metrics.close()


def ray_data_stream(cfg: PretrainConfig, shards):
    """The training stream for ``loader="ray_data"``: shard reads, then decode + augment as data tasks.

    Ray Data stalls when the training workers hold every CPU, so refuse a layout
    that leaves none for the data tasks instead of hanging.
    """
    import ray

    from pipelines.ray_source import read_shards
    from training import randaugment
    from training.data import DecodeBatch, canvas_shape

    total = int(ray.cluster_resources().get("CPU", 0))
    reserved = cfg.num_workers * cfg.cpus_per_worker
    if reserved >= total:
        raise ConfigError(
            f"loader: ray_data needs CPUs for its data tasks, but the {cfg.num_workers} workers reserve "
            f"{reserved} of the cluster's {total} CPUs; lower num_workers or cpus_per_worker, or use loader=shards"
        )
    decode = DecodeBatch(cfg.img_size, label_mode="multi" if cfg.loss == "sigmoid" else "single",
                         num_classes=len(shards.label_map), holdout=cfg.holdout, fraction=cfg.fraction,
                         canvas=canvas_shape(shards, cfg.img_size) if cfg.device_augment else None,
                         randaug=randaugment.from_config(cfg.randaug, cfg.seed))
    columns = ["key", "image", "format", "height", "width", "labels"]
    return read_shards(cfg.data, columns=columns).map_batches(decode, batch_format="numpy", batch_size=64)


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
    if not cfg.storage_path:
        return str(output / "ray"), None
    if not is_url(cfg.storage_path):
        return str(Path(durable_path(cfg.storage_path, "storage_path")).expanduser().resolve()), None

    try:
        fs, path = pyarrow.fs.FileSystem.from_uri(cfg.storage_path)
    except (pyarrow.ArrowInvalid, pyarrow.ArrowNotImplementedError):
        try:
            fsspec_fs, path = url_to_fs(cfg.storage_path)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"storage_path: {cfg.storage_path!r} is neither a pyarrow nor an fsspec URL ({exc}); "
                              "pass a path on shared storage or e.g. s3://bucket/runs") from None
        fs = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fsspec_fs))
    return path, fs


def lock_run_folder(cfg: PretrainConfig, storage: tuple[str, Any], held: contextlib.ExitStack) -> None:
    """With ``--storage-path`` on a disk, the checkpoints are written outside ``--output``: the run's
    folder there is locked too, so two outputs naming one storage path and run name cannot write
    one run's checkpoints. (The default, ``OUTPUT/ray``, is under the output's own lock.)"""
    path, fs = storage
    if cfg.storage_path and fs is None:
        held.enter_context(FolderLock(make_output_dir(Path(path) / cfg.run_name), "pretrain"))


def _images(cfg: PretrainConfig) -> Any:
    """A few training images through the evaluation transform, for the attention-distance figure."""
    import torch

    from training.data import ShardImageDataset, eval_transform

    ds = ShardImageDataset(cfg.data, eval_transform(cfg.img_size))
    return torch.stack([ds[i][0] for i in range(min(8, len(ds)))])


def _inspection_figures(model_path: Path, cfg: PretrainConfig, out_dir: Path) -> list[Path]:
    """vitcore's inspection figures of the trained model (Section 4.5): filter PCs, position-
    embedding similarity and mean attention distance, the last on a few training images. A figure
    for a part the model lacks (``model.lacks``: a BiT ResNet has none of the three) is skipped in one line."""
    import vitcore

    model = vitcore.load_checkpoint(model_path)
    draw = {"embedding_filters": lambda path: vitcore.embedding_filter_pcs(model, path=path),
            "position_embedding_similarity": lambda path: vitcore.position_embedding_similarity(model, path=path),
            "mean_attention_distance": lambda path: vitcore.mean_attention_distance(model, _images(cfg), path=path)}
    needs = {"embedding_filters": "embedding_filters", "position_embedding_similarity": "position_embeddings",
             "mean_attention_distance": "attention"}
    skipped = [name for name in draw if needs[name] in model.lacks]
    if skipped:
        print(f"pretrain: no {', '.join(n.replace('_', ' ') for n in skipped)} figure for {cfg.variant}: it has no "
              f"{', '.join(sorted(needs[n].replace('_', ' ') for n in skipped))}", file=sys.stderr)
    figures = []
    for name, fn in draw.items():
        if name not in skipped:
            fn(out_dir / f"{name}.png")
            figures.append(out_dir / f"{name}.png")
    return figures


def run_pretrain(cfg: PretrainConfig, *, progress: str = "pretrain") -> dict[str, Any]:
    """Run pre-training end to end; returns the final metrics, the saved model's path, the steps
    trained and the worker-group restarts. ``progress`` begins each step line (a study's cell
    names itself there)."""
    # The sets it reads stay as they are for the run: a prepare replacing one, or a dedup, is refused.
    with reading("pretrain", read_sets(cfg)):
        return _run_pretrain(cfg, progress)


def read_sets(cfg: PretrainConfig) -> dict[str, Any]:
    """Every shard set the run reads, by flag (a task folder's splits as ``task/split``)."""
    tasks = task_folders(cfg.fewshot_task, "fewshot_task")
    return {"data": cfg.data, "fewshot_data": cfg.fewshot_data,
            **{f"{name}/{split}": path / split for name, path in tasks.items() for split in SPLITS}}


def _run_pretrain(cfg: PretrainConfig, progress: str) -> dict[str, Any]:
    from training.ray_utils import init_ray

    cfg, shards, uri, (steps_per_epoch, total_steps, train_rows) = _prepare(cfg)
    storage = _storage(cfg, Path(cfg.output))
    # One run at a time in an output folder: two would resume the same run into the same checkpoints.
    check_owner(cfg.output, "pretrain")
    with FolderLock(make_output_dir(Path(cfg.output)), "pretrain"), contextlib.ExitStack() as held:
        claim_folder(cfg.output, "pretrain")
        cfg, resume, output, reopen = _claim(cfg, storage)
        lock_run_folder(cfg, storage, held)
        if reopen is None and (done := _finished(cfg, output, resume, total_steps)):
            return done
        _warn_one_class(cfg, shards)
        own_ray = init_ray(cfg.ray_address)
        datasets = {"train": ray_data_stream(cfg, shards)} if cfg.loader == "ray_data" else {}
        data_record = shard_set_record(cfg.data, role="training")
        records = [data_record] + ([shard_set_record(cfg.fewshot_data, role="evaluation")] if cfg.fewshot_data else [])
        records += task_records(task_folders(cfg.fewshot_task, "fewshot_task"))
        name = f"pretrain {cfg.variant.replace('/', '')} on {data_record['name']}"
        tags = tracking.run_tags(cfg, data=records, main=[data_record])
        if reopen:  # the run this output's interrupted pre-training logged to, as a resumed sweep does
            opened = tracking.start_run("pretrain", run_id=reopen, log_system_metrics=True)
        else:
            opened = tracking.start_run("pretrain", params=dataclasses.asdict(cfg), parent_run_id=cfg.parent_run_id,
                                        run_name=f"{name} ({cfg.run_name})", tags=tags, log_system_metrics=True)
        with opened as run:
            _record_run(output, cfg, run.info.run_id)
            if reopen:
                tracking.refresh_inputs(run.info.run_id, tags, records)
            else:
                tracking.log_shard_inputs(records)
                tracking.log_metrics({"num_rows": shards.num_rows, "train_rows": train_rows,
                                      "num_classes": len(shards.label_map),
                                      "planned_steps": total_steps, "steps_per_epoch": steps_per_epoch,
                                      "accumulation": cfg.accumulation})
            try:
                with interrupts():
                    result, restarts = _fit(cfg, run.info.run_id, uri, datasets, storage, resume, progress)
            except KeyboardInterrupt as exc:
                tracking.end_active_run("KILLED")
                if own_ray:  # its workers stop here, so that the checkpoint named is the newest there will be
                    import ray

                    ray.shutdown()
                raise Interrupted(getattr(exc, "signum", signal.SIGINT), _kept(cfg, storage, total_steps)) from None
            except Exception as exc:  # a full disk at a checkpoint: what was kept, not a worker's traceback
                if (line := disk_line(exc, where=storage[0])) is None:
                    raise
                raise DiskFull(line, _kept(cfg, storage, total_steps)) from None
            summary = carried_over({**_summary(cfg, result, output, shards, run.info.run_id, total_steps, restarts),
                                    "fraction": cfg.fraction, "train_rows": train_rows}, output / SUMMARY)
            _publish(cfg, run, summary, shards, output, name)
            atomic_write(output / SUMMARY, json.dumps(summary, indent=2))
        return summary


def _finished(cfg: PretrainConfig, output: Path, resume: dict, total_steps: int) -> dict | None:
    """The summary of the run ``output`` holds when it finished every step this config plans, under
    the MLflow run its record names: submitted again, the run, model and summary stand, and no
    second MLflow run or model is logged. A longer schedule trains on, in a run of its own."""
    record = read_run_record(output)
    try:
        summary = json.loads((output / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(summary, dict) and record.get("mlflow_run_id")
            and summary.get("mlflow_run_id") == record["mlflow_run_id"]
            and summary.get("steps") == total_steps == resume.get("resume_step")
            and Path(str(summary.get("model", ""))).is_file()):
        return None
    print(f"pretrain: run {cfg.run_name!r} finished its {total_steps} steps already; its model and summary in "
          f"{output} stand (a larger --steps or --epochs trains on, --overwrite starts again)", file=sys.stderr)
    return summary


def _prepare(cfg: PretrainConfig) -> tuple[PretrainConfig, Any, str, tuple[int, int, int]]:
    """The config with absolute paths, its shard set, the tracking URI and (steps per epoch, total
    steps, training rows: those not held out, in the ``fraction`` subset). Checked here, before Ray starts, so the user gets one line instead of worker tracebacks."""
    from training.data import shard_keys, training_mask

    data = Path(cfg.data).expanduser()
    if not (data / MANIFEST).is_file():
        raise ConfigError(f"data: {data} has no {MANIFEST}; {missing_manifest_hint(data)}")
    if cfg.fewshot_data and not (Path(cfg.fewshot_data).expanduser() / MANIFEST).is_file():
        raise ConfigError(f"fewshot_data: {cfg.fewshot_data} has no {MANIFEST}; prepare a labelled shard set "
                          "with jobs/prepare.py and pass its directory")
    shards = ShardSet(str(data))
    _check_labels(cfg, shards)
    tasks = check_task_folders(cfg.fewshot_task, "fewshot_task")
    cfg = dataclasses.replace(cfg, data=str(data.resolve()),
                              fewshot_data=str(Path(cfg.fewshot_data).expanduser().resolve()) if cfg.fewshot_data else None,
                              fewshot_task=[f"{name}={path}" for name, path in tasks.items()])
    output = Path(durable_path(cfg.output, "output")).expanduser().resolve()
    uri = tracking.tracking_uri()
    train_rows = int(training_mask(shard_keys(shards), cfg.holdout, cfg.fraction).sum())
    if not train_rows:
        raise ConfigError(f"fraction: {cfg.fraction} of {data} selects no training rows (holdout {cfg.holdout}); "
                          "raise --fraction, or ingest more images")
    plan = cfg.plan_steps(train_rows, cfg.num_workers)
    return dataclasses.replace(cfg, output=str(output)), shards, uri, (*plan, train_rows)


def _claim(cfg: PretrainConfig, storage: tuple[str, Any]) -> tuple[PretrainConfig, dict, Path, str | None]:
    """Before Ray starts: the run ``output`` holds (or a new one), where it resumes from, checked
    against this config, the output folder with the run's record in it, and the MLflow run to
    reopen (the recorded one, unless it finished)."""
    from training.ray_utils import check_resume_snapshot

    output = make_output_dir(Path(cfg.output))
    before = read_run_record(output)
    cfg = _claim_output(cfg, storage)
    if before.get("run_name") == cfg.run_name and not cfg.overwrite:
        check_same_data(before.get("data"), data_digests(cfg), stage="pretrain", what="run", changed_ok=cfg.data_changed_ok,
                        fix=f"pass --overwrite to start run {cfg.run_name!r} again on it")
    mlflow_run_id = before.get("mlflow_run_id") if before.get("run_name") == cfg.run_name else None
    if before.get("mlflow_run_id") and not mlflow_run_id:
        _close_dead_run(before["mlflow_run_id"])  # --overwrite: the replaced run's process is gone (FolderLock)
    known = check_resume_snapshot(storage[0], cfg.run_name, storage[1])
    resume = _resume_point(cfg, storage, known)
    _record_run(output, cfg, mlflow_run_id)
    return cfg, resume, output, _unfinished(mlflow_run_id)


def read_run_record(output: Path) -> dict:
    try:
        record = json.loads((output / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def data_digests(cfg: PretrainConfig) -> dict[str, dict]:
    """The sha256 of each shard set's manifest, by flag: a resume checks the run's data is the same."""
    sets = {name: Path(path).expanduser() / MANIFEST for name, path in read_sets(cfg).items() if path}
    return {name: {"url": str(manifest.parent), "manifest_sha256": file_sha256(manifest)}
            for name, manifest in sets.items() if manifest.is_file()}


def _record_run(output: Path, cfg: PretrainConfig, mlflow_run_id: str | None) -> None:
    record = {"run_name": cfg.run_name, "config": dataclasses.asdict(cfg), "data": data_digests(cfg)}
    if mlflow_run_id:
        record["mlflow_run_id"] = mlflow_run_id
    atomic_write(output / RUN_RECORD, json.dumps(record, indent=2, default=str))


def _unfinished(mlflow_run_id: str | None) -> str | None:
    """``mlflow_run_id`` when the tracking store holds it and it did not finish (RUNNING after a
    SIGKILL, KILLED after Ctrl-C, FAILED), else None: a new run is opened."""
    from mlflow.exceptions import MlflowException

    if not mlflow_run_id:
        return None
    try:
        status = tracking.get_run(mlflow_run_id).info.status
    except MlflowException:  # another tracking store, or the run was deleted
        return None
    return mlflow_run_id if status in ("RUNNING", "KILLED", "FAILED") else None


def _close_dead_run(mlflow_run_id: str) -> None:
    """Mark a replaced run that a killed process left RUNNING as KILLED."""
    from mlflow.exceptions import MlflowException

    try:
        status = tracking.get_run(mlflow_run_id).info.status
    except MlflowException:
        return
    if status == "RUNNING":
        tracking.end_run(mlflow_run_id, status="KILLED")


def _claim_output(cfg: PretrainConfig, storage: tuple[str, Any]) -> PretrainConfig:
    """The config with the run name to use: the run recorded in ``output`` (:data:`RUN_RECORD`),
    which resumes, or a new one. Refused in one line: another --run-name, or a different recipe,
    over a recorded run, unless ``overwrite``, which removes that run's checkpoints and outputs."""
    from common.config import free_on_resume, off_values
    from training.checkpointer import check_resumable

    output = Path(cfg.output)
    try:
        record = json.loads((output / RUN_RECORD).read_text())
        recorded, saved = str(record["run_name"]), dict(record["config"])
    except FileNotFoundError:
        record = None
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"output: {output / RUN_RECORD} is damaged; pass --overwrite to start the run in {output} "
                          "again, or use another --output") from None
    if record is not None and cfg.overwrite:
        _remove_run(output, recorded, storage)
        record = None
    if record is None:
        return dataclasses.replace(cfg, run_name=cfg.run_name or f"pretrain-{secrets.token_hex(4)}")
    if cfg.run_name and cfg.run_name != recorded:
        raise ConfigError(f"run_name: {output} holds run {recorded!r}, not {cfg.run_name!r}; leave out --run-name "
                          "to resume it, pass --overwrite to replace it, or use another --output")
    cfg = dataclasses.replace(cfg, run_name=recorded)
    check_resumable(saved, dataclasses.asdict(cfg), free_on_resume(cfg), off_values(cfg))
    return cfg


def _remove_run(output: Path, run_name: str, storage: tuple[str, Any]) -> None:
    """A run's outputs in ``output``, and its Ray Train folder when that is on a local disk."""
    from training.best import BEST_MODEL_FILE
    from vitcore.checkpoint import MODEL_FILE

    storage_path, storage_fs = storage
    if storage_fs is None:
        shutil.rmtree(Path(storage_path) / run_name, ignore_errors=True)
    for name in (MODEL_FILE, BEST_MODEL_FILE, SUMMARY, tracking.LINEAGE_FILE, RUN_RECORD):
        (output / name).unlink(missing_ok=True)
    for folder in ("inspection", Path(run_artifacts.PRETRAIN_CURVES).parent, SPOOL_DIR):
        shutil.rmtree(output / folder, ignore_errors=True)


def _resume_point(cfg: PretrainConfig, storage: tuple[str, Any], known: list[str]) -> dict:
    """Where the run continues from, for the workers (:meth:`training.checkpointer.Checkpointer.load`):
    the newest complete checkpoint on a local disk, checked against this config before Ray starts.
    Checkpoint folders no one will read are removed (:func:`training.checkpointer.scan_run`)."""
    from common.config import free_on_resume, off_values
    from training.checkpointer import check_resumable, scan_run

    storage_path, storage_fs = storage
    if storage_fs is not None:  # on remote storage the workers take Ray Train's record
        return {}
    folder, record, _, bad = scan_run(Path(storage_path) / cfg.run_name, known, verify=True)
    if folder is None:
        return {}
    check_resumable(record["cfg"], dataclasses.asdict(cfg), free_on_resume(cfg), off_values(cfg))
    if bad:
        print(f"pretrain: warning: checkpoint: {', '.join(map(str, bad))} does not match the sha256 its "
              f"checkpoint.json records; resuming from {folder} at step {record['step']} instead (remove the "
              "bad folder once you have looked at it)", file=sys.stderr)
    return {"resume_from": str(folder), "resume_step": int(record["step"]), "resume_skip": [p.name for p in bad]}


def _kept(cfg: PretrainConfig, storage: tuple[str, Any], total_steps: int) -> str:
    """What an interrupted run leaves to resume from, in words."""
    from training.checkpointer import newest_checkpoint

    storage_path, storage_fs = storage
    run_dir = posixpath.join(storage_path, cfg.run_name)
    if storage_fs is not None:
        return f"run {cfg.run_name!r} keeps the checkpoints Ray Train recorded in {run_dir}"
    folder, record = newest_checkpoint(Path(run_dir))
    if folder is None:
        return f"run {cfg.run_name!r} had saved no checkpoint yet, so it starts from step 0 again"
    return f"run {cfg.run_name!r} kept its checkpoint at step {record['step']} of {total_steps} ({folder})"


def _check_labels(cfg: PretrainConfig, shards: Any) -> None:
    """The labels the objective needs, checked before Ray starts (a worker would fail on the first batch)."""
    from training.data import check_labelled

    if cfg.objective == "classification":
        check_labelled(shards, "data", unlabelled_fix="pre-train an unlabelled set with --objective mpp (masked patch "
                       "prediction), or prepare it from class folders or a manifest with a label column",
                       several_fix=None if cfg.loss == "sigmoid" else "use --loss sigmoid for a multi-label corpus")
    if cfg.fewshot_data:
        check_labelled(ShardSet(str(Path(cfg.fewshot_data).expanduser())), "fewshot_data", several_fix="pass a "
                       "single-label set", unlabelled_fix="few-shot evaluation needs a labelled shard set")


def _warn_one_class(cfg: PretrainConfig, shards: Any) -> None:
    if cfg.objective == "classification" and len(shards.label_map) < 2:
        labels = ", ".join(map(str, shards.label_names)) or "none"
        print(f"pretrain: warning: data: {cfg.data} has {len(shards.label_map)} classes ({labels}); a classifier "
              "learns nothing from it. Prepare a corpus with several class folders, or use --objective mpp",
              file=sys.stderr)


def _fit(cfg: PretrainConfig, run_id: str, uri: str, datasets: dict, storage: tuple[str, Any],
         resume: dict, progress: str) -> tuple[Any, int]:
    """Ray Train's fit of :func:`train_loop_per_worker`, with the driver's progress lines; returns
    its result and the worker-group restarts."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from training.checkpointer import scan_run
    from training.loopback_torch import LoopbackTorchConfig
    from training.ray_utils import ProgressBoard, check_resume_snapshot

    board = ray.remote(num_cpus=0)(ProgressBoard).remote()
    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_gpu else {}), **(cfg.resources_per_worker or {})}
    storage_path, storage_fs = storage
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": dataclasses.asdict(cfg), "mlflow_run_id": run_id, "mlflow_uri": uri,
                           "progress": board, **resume},
        datasets=datasets,
        torch_config=LoopbackTorchConfig(),
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                     resources_per_worker=resources),
        run_config=RunConfig(
            name=cfg.run_name,
            storage_path=storage_path,
            storage_filesystem=storage_fs,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
            failure_config=FailureConfig(max_failures=cfg.max_failures),
        ),
    )
    shown = StepProgress(ProgressLine(progress), board)
    try:
        try:
            # Poll at least as often as lines are due: a short run's steps must not all fall
            # between two polls (only the newest step of each poll gets a line).
            every = progress_every()
            with Ticker(shown.tick, max(0.05, min(TTY_EVERY, every) if every > 0 else TTY_EVERY)):
                result = _in_thread(trainer.fit)
        except Exception as exc:
            raise _config_error_from_workers(exc) or exc
        finally:
            shown.finish()
        if result.error:
            raise _config_error_from_workers(result.error) or result.error
        if storage_fs is None:  # the checkpoint folders the finished fit's snapshot no longer lists
            scan_run(Path(storage_path) / cfg.run_name, check_resume_snapshot(storage_path, cfg.run_name))
        restarts = max(0, ray.get(board.starts.remote()) - 1)
    finally:
        with contextlib.suppress(Exception):  # Ray may be gone (an interrupt)
            ray.kill(board)
    return result, restarts


def _in_thread(fit: Any) -> Any:
    """``fit()`` in a daemon thread while the main thread waits, so that SIGINT and SIGTERM reach
    :func:`common.cli.interrupts` (in the main thread, Ray Train's fit takes SIGINT itself, and
    ends the process with exit 1 and no word)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fit()
        except BaseException as exc:  # handed to the main thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="pretrain-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    if "error" in box:
        raise box["error"]
    return box["result"]


def _summary(cfg: PretrainConfig, result: Any, output: Path, shards: Any, run_id: str, total_steps: int,
             restarts: int) -> dict[str, Any]:
    """The final checkpoint's model copied beside the summary, and the summary. Its ``sha256``
    holds each model file's digest, which the stages given one as ``--pretrained`` check."""
    from training.best import BEST_MODEL_FILE, summary_record
    from training.checkpointer import sha256_of
    from training.ray_utils import copy_final_model

    model_path = copy_final_model(result, output)
    digests = {model_path.name: sha256_of(model_path)}
    metrics = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float))}
    steps = int(metrics.get("step", 0))
    best = summary_record(metrics)
    if best is not None:  # Section 4.3's early stopping: the model of the best few-shot step, beside the final one
        best_path = copy_final_model(result, output, BEST_MODEL_FILE)
        best["model"], digests[best_path.name] = str(best_path), sha256_of(best_path)
    return {"metrics": metrics, "model": str(model_path), "sha256": digests, "mlflow_run_id": run_id,
            **({"best_fewshot": best} if best else {}),
            "label_map": shards.label_map, "objective": cfg.objective, "steps": steps,
            "planned_steps": total_steps, "restarts": restarts, "checkpoint": result.checkpoint.path,
            "data_position": {"epoch": int(metrics.get("data_epoch", 0)),
                              "offset": int(metrics.get("data_offset", 0)),
                              "rows_seen_in_epoch": int(metrics.get("rows_seen", 0)),
                              "rows_sum": int(metrics.get("rows_sum", 0)),
                              "rows_sumsq": int(metrics.get("rows_sumsq", 0))},
            "resumed_from_step": int(metrics.get("start_step", 0)), "nodes": int(metrics.get("nodes", 1))}


def carried_over(summary: dict, earlier: Path) -> dict:
    """A finished run submitted again trains no step, so its last checkpoint reports only where it
    stands: the figures of its end (held-out and train accuracy and loss) come from the summary
    it wrote when it finished, so the rerun's summary says what the first one did."""
    if summary["resumed_from_step"] != summary["steps"] or not summary["steps"]:
        return summary
    try:
        before = json.loads(earlier.read_text())
    except (OSError, ValueError):
        return summary
    if not isinstance(before, dict) or before.get("steps") != summary["steps"]:
        return summary
    return {**summary, "metrics": {**(before.get("metrics") or {}), **summary["metrics"]}}


def _publish(cfg: PretrainConfig, run: Any, summary: dict, shards: Any, output: Path, name: str) -> None:
    """Into the MLflow run: the summary, inspection figures, curves, lineage and the model
    (registered under ``register_as``); ``summary`` gains where they went."""
    run_id, model_path = run.info.run_id, Path(summary["model"])
    tracking.log_metrics({"restarts": summary["restarts"], "steps": summary["steps"],
                          "resumed_from_step": summary["resumed_from_step"],
                          **{k: v for k, v in summary["metrics"].items() if k.startswith("best_fewshot_")}})
    tracking.log_dict(summary, "pretrain_summary.json")
    figures = _inspection_figures(model_path, cfg, output / "inspection")
    for fig in figures:
        tracking.log_artifact(fig, "inspection")
    summary["inspection"] = [str(f) for f in figures]
    fewshot = [k for k in tracking.get_run(run_id).data.metrics if k.startswith("fewshot_")]
    curves = run_artifacts.pretrain_curves(
        tracking.metric_history(run_id, ["train_loss", "holdout_loss", "lr", "images_per_second",
                                         "train_accuracy", "holdout_accuracy", *fewshot]),
        output / run_artifacts.PRETRAIN_CURVES, title=name)
    if curves is not None:
        tracking.log_artifact(curves, "plots")
    # Beside the model, for the stages that read it: this run and its lineage.
    tracking.write_lineage(output, run, "pretrain")
    info = run_artifacts.log_vit_model(model_path, name=run_artifacts.model_name("pretrain", cfg.variant, Path(cfg.data).name),
                                       labels=shards.label_names, scores=cfg.loss,
                                       metadata={"vitscale.pretrain_run_id": run_id, "vitscale.objective": cfg.objective})
    summary["mlflow_model_uri"] = info.model_uri
    if cfg.register_as:
        import vitcore

        config = vitcore.read_checkpoint(model_path)[0].to_dict()
        summary["registered"] = tracking.register_model(
            cfg.register_as, info.model_uri,
            tags={"vitscale.model_config": json.dumps(config),
                  "vitscale.data_manifest_sha256": file_sha256(Path(cfg.data) / MANIFEST),
                  "vitscale.data": cfg.data, "vitscale.pretrain_run_id": run_id})
