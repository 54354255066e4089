"""One Ray Train worker's pre-training, as a trainer object in torchtitan's shape.

:meth:`Trainer.build` makes the data stream, the model, the optimiser, the checkpointer (which
restores the latest checkpoint) and the metrics sink; :meth:`Trainer.train` steps to the end of
the submission, and the components decide when to log, evaluate and save.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.utils.data import ConcatDataset, DataLoader, DistributedSampler

import vitcore
from common.tracking_queue import SPOOL_DIR
from training import randaugment
from training.augment import device_batch
from training.best import BestFewshot
from training.checkpointer import Checkpointer, DataPosition, gather, has_peers
from training.data import (
    ShardCropDataset,
    ShardImageDataset,
    collate_crops,
    eval_transform,
    holdout_mask,
    normalize,
    release_canvases,
    shard_keys,
    split_rows,
    subset_mask,
    train_transform,
)
from training.ema import Polyak
from training.loop import (
    accumulate_step,
    autocast,
    effective_warmup,
    evaluate,
    lr_at,
    set_lr,
    unwrap,
)
from training.losses import classification_loss
from training.metrics import MetricsSink
from training.mixup import Mixer
from training.step import adamw, compile_mode, compile_model
from training.task_folders import FIT_SPLITS, TEST_SPLIT, task_folders
from vitcore.variants import decode_variant, is_bit_variant


class Trainer:
    """Pre-trains ``cfg``'s model on this worker's slice of the shards; ``run`` is what the driver
    passes to every worker (the MLflow run, the progress board, the start counter)."""

    def __init__(self, cfg: Any, run: dict) -> None:
        ctx = ray.train.get_context()
        self.cfg, self.run = cfg, run
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        self.mpp = cfg.objective == "mpp"
        self.step = self.start_step = self.micro = 0

    def build(self) -> Trainer:
        """Data, model, optimiser, checkpointer (restoring the latest checkpoint) and metrics sink."""
        cfg = self.cfg
        torch.set_num_threads(max(1, cfg.cpus_per_worker))
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        if self.rank == 0 and self.run.get("progress") is not None:
            ray.get(self.run["progress"].start.remote())
        self.nodes = len(set(gather(ray.get_runtime_context().get_node_id())))
        train_ds, held_ds, num_classes = _datasets(cfg)
        self.label_names = [] if self.mpp else list(train_ds.shards.label_names)  # the model file names its classes
        self.steps_per_epoch, self.total_steps = cfg.plan_steps(len(train_ds), self.world)
        self.held_out = None if self.mpp or not len(held_ds) else HeldOut(held_ds, cfg, self.rank, self.world)
        self.model, self.dist_model, self.trainable = self._build_model(num_classes)
        self.num_classes, self.mixer = num_classes, _mixer(cfg)
        self.randaug = randaugment.from_config(cfg.randaug, cfg.seed)  # the device path's; items get theirs in _datasets
        # The average of the backbone's weights (the model the run saves), on the device, in fp32.
        self.ema = Polyak(self.model, cfg.ema_decay) if cfg.ema_decay else None
        # Dropout and MPP corruption differ between ranks; the initial weights above did not.
        torch.manual_seed(cfg.seed * 1_000_003 + 1 + self.rank)
        self.opt = _optimizer(cfg, self.dist_model)
        self.warmup = effective_warmup(cfg.warmup_steps, self.total_steps)
        self.position = DataPosition(self.steps_per_epoch)
        self.checkpointer = Checkpointer(cfg, steps_per_epoch=self.steps_per_epoch, total_steps=self.total_steps,
                                         rank=self.rank, world=self.world)
        self.end_step = self.checkpointer.last_step
        self.best = BestFewshot()
        self.checkpointer.load(self)
        stream = RayDataStream if cfg.loader == "ray_data" else ShardStream
        self.data = stream(cfg, train_ds, self.rank, self.world, self.steps_per_epoch, self.device)
        self.fewshot = _fewshot_sets(cfg) if cfg.fewshot_every else None
        peak = vitcore.bf16_peak_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        self.metrics = MetricsSink(rank=self.rank, world=self.world, device=self.device,
                                   run_id=self.run["mlflow_run_id"], uri=self.run["mlflow_uri"],
                                   board=self.run.get("progress"), log_every=cfg.log_every,
                                   total_steps=self.total_steps, end_step=self.end_step, peak_flops=peak,
                                   flops_per_image=vitcore.train_flops_per_image(self.model),
                                   spool=Path(cfg.output) / SPOOL_DIR)
        return self

    def _build_model(self, num_classes: int) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
        """(the ViT, the module DDP or FSDP wraps, the module that trains: the wrapper, compiled or not)."""
        cfg = self.cfg
        # The official i21k recipe: head bias -10 so every sigmoid starts near zero.
        head = {"head_bias_init": -10.0 if cfg.loss == "sigmoid" else 0.0}
        if not is_bit_variant(cfg.variant):
            # Pre-training head: one tanh hidden layer as wide as the model (Section 3.1); a BiT
            # ResNet has one dense layer on its pooled features, and no dropout.
            head.update(representation_size=None if self.mpp else cfg.width or decode_variant(cfg.variant)["width"],
                        dropout=cfg.dropout)
        model = vitcore.create_model(
            cfg.variant,
            # MPP predicts per-patch colours with its own head; the class head is not used.
            num_classes=0 if self.mpp else num_classes,
            img_size=cfg.img_size,
            **head,
            **model_options(cfg),
        )
        trainable = vitcore.MaskedPatchPrediction(model) if self.mpp else model
        if cfg.strategy == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            trainable.to(self.device)
            shard_opts = {}
            if self.device.type == "cuda" and cfg.bf16:
                # bf16 parameters and activations, fp32 gradient reduction and optimiser state.
                shard_opts["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, **shard_opts)
            fully_shard(trainable, **shard_opts)
            dist_model = trainable
        else:
            dist_model = ray.train.torch.prepare_model(trainable)
        return model, dist_model, compile_model(dist_model, compile_mode(cfg.compile, self.device.type))

    def state_dict(self) -> dict:
        """The model and optimiser, whole (FSDP gathers its shards: every rank calls this), and the step."""
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {"model": get_model_state_dict(self.dist_model, options=full),
                "optimizer": get_optimizer_state_dict(self.dist_model, self.opt, options=full),
                "step": self.step, **({"ema": self.ema.state_dict()} if self.ema else {})}

    def load_state_dict(self, state: dict) -> None:
        """The model, optimiser, average and step of a checkpoint's ``state``. With several ranks,
        rank 0 alone holds the tensors and broadcasts them; the other ranks pass the state without
        them (:func:`training.checkpointer.small_state`)."""
        spread = has_peers()
        full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=spread)
        set_model_state_dict(self.dist_model, state.get("model", {}), options=full)
        set_optimizer_state_dict(self.dist_model, self.opt, state.get("optimizer", {}), options=full)
        self.step = int(state["step"])
        if self.ema is not None:
            if spread:
                set_model_state_dict(self.ema.model, state["ema"].get("model", {}), options=full)
                self.ema.updates = int(state["ema"]["updates"])
            else:
                self.ema.load_state_dict(state["ema"])

    def plain_model(self, model_sd: dict) -> torch.nn.Module:
        """The model file's ViT or BiT ResNet from a whole state dict: MPP's backbone without its patch head."""
        if self.mpp:
            model_sd = {k[len("backbone."):]: v for k, v in model_sd.items() if k.startswith("backbone.")}
        plain = self.blank_model()
        plain.load_state_dict(model_sd)
        return plain

    def published_model(self, state: dict) -> torch.nn.Module:
        """The model file's weights: the average with ``ema_decay``, else the trained ones."""
        if self.ema is None:
            return self.plain_model(state["model"])
        plain = self.blank_model()
        plain.load_state_dict(state["ema"]["model"])
        return plain

    def blank_model(self) -> torch.nn.Module:
        """A new model of this run's class and config, its initial weights drawn from a forked
        random stream: a checkpoint taken at step s leaves dropout's and drop path's stream where
        the run cut at s and resumed finds it."""
        with torch.random.fork_rng(devices=[]):
            return type(self.model)(self.model.config)

    def train(self) -> None:
        """Step to the end of the schedule, or to ``stop_after``."""
        self.start_step = self.step
        self.trainable.train()
        self.metrics.start()
        while self.step < self.end_step:
            if self.position.epoch_done:
                self.position.next_epoch()
            batches = iter(self.data.epoch(self.position.epoch, self.position.offset))
            while not self.position.epoch_done and self.step < self.end_step:
                lr, grad_norm = self.train_step(batches)
                self.metrics.log_step(self.step, lr, grad_norm)
                self.score_fewshot()
                due = self.checkpointer.due(self.step, self.position.offset)
                held = self.evaluate_held_out(log=not due)
                if due:
                    self.save(self.metrics.report(self.step, self.position.epoch, held))
                    self.metrics.saved()
            del batches  # ends the epoch's loader processes before the next epoch starts its own
        if self.step == self.start_step:  # a finished run submitted again: hand the driver its checkpoint
            epoch, offset = self.position.epoch, self.position.offset
            self.save({"epoch": epoch if offset else max(0, epoch - 1), "step": self.step})

    def train_step(self, batches: Iterator) -> tuple[float, torch.Tensor]:
        """One optimiser step over ``accumulation`` micro-batches; returns its learning rate and gradient norm."""
        cfg = self.cfg
        lr = lr_at(self.step, total=self.total_steps, warmup=self.warmup, peak=cfg.lr, schedule=cfg.schedule)
        set_lr(self.opt, lr)
        loss, grad_norm = accumulate_step(self.trainable, self.opt, self._microbatches(batches), self._loss,
                                          count=cfg.accumulation, grad_clip=cfg.grad_clip)
        self.position.advance(self.data.rows(self.position.epoch, self.position.offset))
        self.step += 1
        if self.ema is not None:
            self.ema.update(self.model)
        self.metrics.record(cfg.batch_size // self.world, loss)
        return lr, grad_norm

    def _microbatches(self, batches: Iterator) -> Iterator:
        for self.micro in range(self.cfg.accumulation):
            t = time.perf_counter()
            batch = next(batches)
            self.metrics.record_wait(time.perf_counter() - t)
            yield batch

    def _loss(self, batch) -> torch.Tensor:
        # augment="device": the CPU only decoded and copied each crop; the per-pixel work is batched here.
        if isinstance(batch, dict):
            x, y = device_batch(batch, self.cfg.img_size, self.device, self.randaug,
                                key=(self.step, self.rank, self.micro))
        else:
            x, y = batch
            # uint8 batches (Ray Data) cross to the device at a quarter of the bytes, then normalise there.
            x, y = normalize(x.to(self.device, non_blocking=True)), y.to(self.device, non_blocking=True)
        if self.mixer.on:  # the batch's place in the schedule seeds its mix: a resume mixes it again the same
            x, y = self.mixer(x, y, self.num_classes, key=(self.step, self.rank, self.micro))
        with autocast(self.device, self.cfg.bf16):
            if self.mpp:
                # Appendix B.1.2: loss only on the corrupted patches; "accuracy" is per patch.
                logits, targets, corrupted = self.trainable(x)
                logits, targets = logits[corrupted].float(), targets[corrupted]
                self.metrics.record_correct((logits.argmax(1) == targets).float().mean().detach() * x.shape[0])
                return F.cross_entropy(logits, targets)
            loss_sum, correct = classification_loss(self.trainable(x), y, head=self.cfg.loss,
                                                    label_smoothing=self.cfg.label_smoothing)
        self.metrics.record_correct(correct.detach())
        return loss_sum / x.shape[0]

    def score_fewshot(self) -> None:
        if self.fewshot is None or self.step % self.cfg.fewshot_every:
            return
        # Every rank runs the forward (FSDP's is collective); rank 0 logs.
        target = unwrap(self.trainable)
        model = self.ema.model if self.ema else target.backbone if self.mpp else target
        # Rank 0's scores decide the best step on every rank: keeping its model may be a collective.
        scores: dict[str, float] = {}
        for fewshot in self.fewshot:
            scores.update(_fewshot_scores(model, fewshot, self.cfg.microbatch_size, self.cfg.fewshot_shots))
        scores = gather(scores)[0]
        if scores:
            self.metrics.log(scores, self.step)
            if self.best.update(scores, self.step):
                self.keep_best()
        self.trainable.train()

    def keep_best(self) -> None:
        """This step's published model as the best; every rank calls it (FSDP gathers), rank 0 keeps it."""
        if self.ema is not None:
            weights = {"ema": self.ema.state_dict()} if self.rank == 0 else None
        else:
            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights = {"model": get_model_state_dict(self.dist_model, options=full)}
        if self.rank == 0:
            self.best.model = self.published_model(weights)

    def evaluate_held_out(self, *, log: bool) -> dict[str, float]:
        """Held-out loss and accuracy at the end of each epoch and of the submission; ``log`` when
        no report will carry them."""
        if self.held_out is None or not (self.position.offset == self.steps_per_epoch or self.step == self.end_step):
            return {}
        scores = evaluate(self.trainable, self.held_out.batches(), self.device, self.cfg.bf16)
        self.trainable.train()
        held = {"holdout_loss": scores["loss"], "holdout_accuracy": scores["accuracy"]}
        if log:
            self.metrics.log(held, self.step)
        return held

    def save(self, metrics: dict) -> None:
        self.checkpointer.save(self, {**metrics, **self.best.metrics(), "start_step": self.start_step,
                                      "nodes": self.nodes})


def model_options(cfg: Any) -> dict[str, Any]:
    """The vitcore ``create_model`` options a stage config asks for."""
    opts = {k: getattr(cfg, k) for k in ("depth", "width", "mlp_dim", "num_heads") if getattr(cfg, k, None) is not None}
    if getattr(cfg, "grad_checkpointing", False):
        opts["grad_checkpointing"] = True
    if getattr(cfg, "drop_path", 0.0):  # off: the option is not passed, so a BiT ResNet is built as before
        opts["drop_path_rate"] = cfg.drop_path
    if getattr(cfg, "posemb", "learn") != "learn":
        opts["posemb"] = cfg.posemb
    if getattr(cfg, "classifier", "token") != "token":
        opts["classifier"] = cfg.classifier
    return opts


def _mixer(cfg: Any) -> Mixer:
    switch = 0.5 if cfg.mixup_switch_prob is None else cfg.mixup_switch_prob
    return Mixer(mixup=cfg.mixup, cutmix=cfg.cutmix, switch_prob=switch, seed=cfg.seed)


def _optimizer(cfg: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    return adamw(model, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=cfg.fused_adamw)


def _datasets(cfg: Any) -> tuple[ShardImageDataset, ShardImageDataset, int]:
    """(training rows, held-out rows, number of classes) of ``cfg.data``. With ``device_augment``
    the training rows are crop batches (:class:`ShardCropDataset`); the held-out rows stay per item."""
    randaug = randaugment.from_config(cfg.randaug, cfg.seed)
    full = ShardImageDataset(cfg.data, train_transform(cfg.img_size, randaug=randaug),
                             label_mode="multi" if cfg.loss == "sigmoid" else "single", seed=cfg.seed)
    keys = shard_keys(full.shards)
    held_out = holdout_mask(keys, cfg.holdout)
    train_rows = np.flatnonzero(~held_out & subset_mask(keys, cfg.fraction))  # --fraction: a nested subset
    if cfg.device_augment:
        train_ds = ShardCropDataset(full.shards, cfg.img_size, label_mode=full.label_mode,
                                    rows=train_rows, seed=cfg.seed)
    else:
        train_ds = ShardImageDataset(full.shards, full.transform, label_mode=full.label_mode,
                                     rows=train_rows, seed=cfg.seed)
    held_ds = ShardImageDataset(full.shards, eval_transform(cfg.img_size), label_mode=full.label_mode,
                                rows=np.flatnonzero(held_out), seed=cfg.seed)
    return train_ds, held_ds, full.num_classes


def _own_generator(seed: int) -> torch.Generator:
    # A DataLoader iterator draws its base seed from the global RNG unless given its own;
    # that would make the dropout stream depend on where a run was resumed.
    return torch.Generator().manual_seed(seed)


def epoch_rows(n: int, world: int, rank: int, seed: int, epoch: int) -> np.ndarray:
    """Dataset positions that ``rank`` trains on in ``epoch``, in order: one seeded permutation per
    epoch, cut to a multiple of ``world`` and dealt round-robin (DistributedSampler's rule). A
    data position (epoch, steps done) therefore names exactly the rows already seen."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g).numpy()
    return perm[: n // world * world][rank::world]


class ShardStream:
    """This rank's batches from the memory-mapped shards, in :func:`epoch_rows` order, so that a
    resume starts at the exact row."""

    def __init__(self, cfg: Any, ds: ShardImageDataset, rank: int, world: int, steps_per_epoch: int,
                 device: torch.device) -> None:
        self.cfg, self.ds, self.rank, self.world, self.device = cfg, ds, rank, world, device
        self.per_worker, self.steps_per_epoch = cfg.batch_size // world, steps_per_epoch

    def _order(self, epoch: int) -> np.ndarray:
        return epoch_rows(len(self.ds), self.world, self.rank, self.cfg.seed, epoch)

    def epoch(self, epoch: int, offset: int) -> Iterator:
        rows = self._order(epoch)[offset * self.per_worker: self.steps_per_epoch * self.per_worker]
        self.ds.set_epoch(epoch)
        crops = {"collate_fn": collate_crops} if isinstance(self.ds, ShardCropDataset) else {}
        loader = DataLoader(self.ds, batch_size=self.cfg.microbatch_size, sampler=rows.tolist(), drop_last=True,
                            num_workers=self.cfg.dataloader_workers, pin_memory=self.device.type == "cuda",
                            generator=_own_generator(self.cfg.seed), **crops)
        # The trainer is done with a micro-batch's canvas when it asks for the next (_loss resizes it
        # into a new tensor), so DataLoader processes may write into it again.
        yield from release_canvases(loader) if crops else loader

    def rows(self, epoch: int, offset: int) -> np.ndarray:
        """The shard rows of step ``offset`` of ``epoch``."""
        rows = self._order(epoch)[offset * self.per_worker:(offset + 1) * self.per_worker]
        return self.ds.rows[rows].astype(np.float64)


class RayDataStream:
    """This rank's share of the Ray Data stream the driver set up (``loader="ray_data"``)."""

    def __init__(self, cfg: Any, ds: ShardImageDataset, rank: int, world: int, steps_per_epoch: int,
                 device: torch.device) -> None:
        self.stream = ray.train.get_dataset_shard("train")
        self.cfg, self.per_worker, self.steps_per_epoch = cfg, cfg.batch_size // world, steps_per_epoch

    def epoch(self, epoch: int, offset: int) -> Iterator:
        # A stream cannot seek: a resume skips the epoch's first `offset` steps of a fresh
        # shuffle. Ray Train splits the stream equally, so every worker takes the same steps.
        accum = self.cfg.accumulation
        batches = self.stream.iter_torch_batches(batch_size=self.cfg.microbatch_size, drop_last=True,
                                                 local_shuffle_buffer_size=4 * self.per_worker)
        for i, batch in enumerate(batches):
            if i == self.steps_per_epoch * accum:
                break
            if i >= offset * accum:
                yield batch if self.cfg.device_augment else (batch["image"], batch["label"])

    def rows(self, epoch: int, offset: int) -> None:
        return None


class HeldOut:
    """This rank's share of the held-out rows, in a fixed order."""

    def __init__(self, ds: ShardImageDataset, cfg: Any, rank: int, world: int) -> None:
        self.ds, self.cfg = ds, cfg
        self.sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)

    def batches(self) -> DataLoader:
        return DataLoader(self.ds, batch_size=self.cfg.microbatch_size, sampler=self.sampler,
                          generator=_own_generator(self.cfg.seed))


FEWSHOT_ROWS = 2000  # images held per few-shot set (and per task split): a bound on each scoring's cost
DEFAULT_SHOTS = (1, 5, 10, 25)


def _fewshot_sets(cfg: Any) -> list[dict]:
    """The few-shot sets scored during training: ``fewshot_data`` split in half, then each task folder."""
    sets = [_fewshot_set(cfg)] if cfg.fewshot_data else []
    for name, path in task_folders(cfg.fewshot_task, "fewshot_task").items():
        sets.append(_task_set(cfg, name, path))
    return sets


def _sample(ds: Any, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    rows = np.random.default_rng(seed).permutation(len(ds))[:FEWSHOT_ROWS]
    xs, ys = zip(*(ds[int(i)] for i in rows))
    return torch.stack(xs), np.asarray(ys)


def _fewshot_set(cfg: Any) -> dict:
    """Images and labels of ``fewshot_data`` (at most 2,000 rows), split in half for fit and test."""
    ds = ShardImageDataset(cfg.fewshot_data, eval_transform(cfg.img_size))
    x, y = _sample(ds, cfg.seed)
    fit, test = split_rows(len(y), 0.5, cfg.seed)
    return {"x": x, "y": y, "fit": fit, "test": test, "num_classes": ds.num_classes}


def _task_set(cfg: Any, name: str, path: Path) -> dict:
    """A task folder's few-shot set: fit on train800 and val200, test on test (at most 2,000 rows each)."""
    transform = eval_transform(cfg.img_size)
    fit_x, fit_y = _sample(ConcatDataset([ShardImageDataset(str(path / s), transform) for s in FIT_SPLITS]), cfg.seed)
    test_x, test_y = _sample(ShardImageDataset(str(path / TEST_SPLIT), transform), cfg.seed)
    n, m = len(fit_y), len(test_y)
    return {"x": torch.cat([fit_x, test_x]), "y": np.concatenate([fit_y, test_y]), "fit": np.arange(n),
            "test": np.arange(n, n + m), "prefix": f"fewshot_{name}_"}


def _fewshot_scores(model: torch.nn.Module, fewshot: dict, batch_size: int,
                    shots: list[int] | None = None) -> dict[str, float]:
    """Few-shot linear accuracy (vitcore's closed-form evaluator) for every shot count (of ``shots``,
    default 1, 5, 10, 25) the fit rows can fill: the paper's cheap way to follow pre-training (Section 4.1)."""
    feats = vitcore.compute_representations(model, fewshot["x"], batch_size=batch_size)
    y, fit, test = fewshot["y"], fewshot["fit"], fewshot["test"]
    # Classes with no fit example cannot be learned from shots: evaluate on the others.
    classes = np.unique(y[fit])
    counts = np.bincount(np.searchsorted(classes, y[fit]), minlength=len(classes))
    shots = [k for k in (shots or DEFAULT_SHOTS) if counts.min() >= k]
    test_keep = np.isin(y[test], classes)
    if len(classes) < 2 or not shots or not test_keep.any():
        return {}
    fit_y, test_y = np.searchsorted(classes, y[fit]), np.searchsorted(classes, y[test][test_keep])
    results = vitcore.fewshot_accuracy(feats[fit], fit_y, feats[test][test_keep], test_y,
                                       num_classes=len(classes), shots=shots, seeds=(0,))
    prefix = fewshot.get("prefix", "fewshot_")
    return {f"{prefix}{k}shot_accuracy": r["mean"] for k, r in results.items()}
