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
and ``microbatch`` what goes through the model at once (:func:`accumulated_step`).

Sweeps live under ``OUTPUT/ray/<name>``; running the same command again after an interruption
restores them (finished trials are kept, unfinished and errored ones run again) and reopens the
same MLflow run.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil
import tempfile
import time
from dataclasses import field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from common import progress
from common.config import ConfigError, check, not_recipe
from training.pretrain import MODEL_FILE

PAPER_LR_GRID = [0.001, 0.003, 0.01, 0.03]
# Appendix B.1.1: the development sub-split per dataset, matched against --dataset or the
# train folder's name; anything else gets DEFAULT_DEV_FRACTION.
PAPER_DEV_FRACTIONS = {"pets": 0.1, "flowers": 0.1, "cifar": 0.02, "imagenet": 0.01}
DEFAULT_DEV_FRACTION = 0.1
STATE_FILE = "sweep_state.json"


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


def check_batching(batch_size: int, microbatch: int) -> None:
    check(microbatch >= 0, "microbatch", f"must be >= 0, got {microbatch}")
    check(microbatch == 0 or batch_size % microbatch == 0, "microbatch",
          f"--batch-size {batch_size} must be a multiple of --microbatch {microbatch}")


# -- the training step and loop, shared with VTAB --------------------------------------------------

def accumulated_step(model, opt, microbatches: Iterable, total: int, *, grad_clip: float, device, bf16: bool) -> float:
    """One optimiser step over ``total`` examples that arrive as several microbatches.

    Each microbatch's summed loss is divided by ``total`` before its backward pass, so the
    accumulated gradient is the mean-loss gradient of the whole batch, which is what one large
    batch would give; clipping and the step then see the full batch. Returns the batch's mean loss.
    """
    import torch
    import torch.nn.functional as F

    from training.loop import autocast

    opt.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for x, y in microbatches:
        x, y = x.to(device), y.to(device)
        with autocast(device, bf16):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y, reduction="sum") / total
        loss.backward()
        loss_sum += float(loss.detach())
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return loss_sum


class Polyak:
    """Exponential moving average of a model's weights (Polyak & Juditsky averaging, as the paper's
    ImageNet fine-tunes use with 0.9999).

    The decay ramps up as ``min(decay, (1 + n) / (10 + n))`` after n updates (TensorFlow's
    ExponentialMovingAverage with ``num_updates``): with a constant 0.9999 a 500-step run would
    report weights that are still 95% the pre-trained ones with an untrained zero head.
    """

    def __init__(self, model, decay: float):
        import torch

        self.decay = decay
        self.updates = 0
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._torch = torch

    def update(self, model) -> None:
        with self._torch.no_grad():
            d = min(self.decay, (1 + self.updates) / (10 + self.updates))
            for avg, p in zip(self.model.parameters(), model.parameters()):
                avg.lerp_(p.detach(), 1.0 - d)
            for avg, b in zip(self.model.buffers(), model.buffers()):
                avg.copy_(b)
        self.updates += 1


@dataclasses.dataclass
class TrainSpec:
    """What one fine-tuning run needs besides its data and model."""

    lr: float
    steps: int
    batch_size: int
    microbatch: int = 0
    warmup_steps: int = 500
    grad_clip: float = 1.0
    momentum: float = 0.9
    polyak: float = 0.0
    bf16: bool = True
    seed: int = 0


def microbatch_stream(dataset, micro: int, seed: int) -> Iterator:
    """Shuffled microbatches forever, reshuffled (and re-augmented) each epoch."""
    import torch
    from torch.utils.data import DataLoader

    gen = torch.Generator().manual_seed(seed)
    loader = DataLoader(dataset, batch_size=micro, shuffle=True, drop_last=True, generator=gen)
    epoch = 0
    while True:
        for d in getattr(dataset, "datasets", [dataset]):
            if hasattr(d, "set_epoch"):
                d.set_epoch(epoch)
        yield from loader
        epoch += 1


def train_sgd(model, train_ds, spec: TrainSpec, device, *,
              on_eval: Callable[[Any, int, float], None] | None = None, eval_every: int = 0):
    """SGD fine-tuning with warm-up + cosine, clipping, accumulation and optional Polyak averaging.

    Returns ``(evaluated_model, stats)``: the averaged model when ``spec.polyak`` is set, else the
    trained one. ``on_eval(model, step, train_loss)`` is called every ``eval_every`` steps.
    """
    import torch

    from training.loop import effective_warmup, lr_at, set_lr

    batch = min(spec.batch_size, len(train_ds))
    micro = min(spec.microbatch or batch, batch)
    per_step = max(1, batch // micro)
    batch = per_step * micro
    stream = microbatch_stream(train_ds, micro, spec.seed)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum, weight_decay=0.0)
    warmup = effective_warmup(spec.warmup_steps, spec.steps)
    avg = Polyak(model, spec.polyak) if spec.polyak else None
    model.train()
    t0 = time.perf_counter()
    loss = float("nan")
    for step in range(spec.steps):
        set_lr(opt, lr_at(step, total=spec.steps, warmup=warmup, peak=spec.lr, schedule="cosine"))
        loss = accumulated_step(model, opt, (next(stream) for _ in range(per_step)), batch,
                                grad_clip=spec.grad_clip, device=device, bf16=spec.bf16)
        if avg is not None:
            avg.update(model)
        if on_eval and eval_every and (step + 1) % eval_every == 0 and step + 1 < spec.steps:
            on_eval(avg.model if avg else model, step + 1, loss)
    stats = {"train_loss": loss, "images_per_second": spec.steps * batch / (time.perf_counter() - t0),
             "batch_size": batch, "microbatch": micro}
    return (avg.model if avg else model), stats


def build_model(cfg: FinetuneConfig, num_classes: int):
    """The pre-trained backbone with a fresh zero-initialised head, at the fine-tuning resolution."""
    return load_backbone(cfg.pretrained, cfg.variant, cfg.img_size, num_classes)


def load_backbone(pretrained: str | None, variant: str, img_size: int | None, num_classes: int):
    """A pre-trained model (position embeddings interpolated to ``img_size``) with the whole head
    replaced by one zero-initialised linear layer; or ``variant`` from scratch."""
    import vitcore

    if pretrained:
        model = vitcore.load_checkpoint(pretrained, **({"img_size": img_size} if img_size else {}))
    else:
        model = vitcore.create_model(variant, num_classes=num_classes, img_size=img_size or 224)
    return vitcore.reset_head(model, num_classes)


def trial_device(gpus_per_trial: float):
    import torch

    return torch.device("cuda" if gpus_per_trial and torch.cuda.is_available() else "cpu")


def report_final(metrics: dict, model) -> None:
    """Report a trial's last result to Tune with its model as the checkpoint."""
    from ray import tune

    import vitcore

    with tempfile.TemporaryDirectory() as d:
        vitcore.save_checkpoint(model, Path(d) / MODEL_FILE)
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))


def finetune_trial(config: dict) -> None:
    """One learning rate. ``phase="select"``: train on train minus dev, report dev (val) accuracy
    (and test, logged only). ``phase="final"``: train on all of train, report test accuracy."""
    import torch
    from ray import tune
    from torch.utils.data import DataLoader

    from common import tracking
    from pipelines.schema import ShardSet
    from training.data import ShardImageDataset, eval_transform, split_rows, train_transform
    from training.loop import evaluate

    cfg = FinetuneConfig(**config["cfg"])
    lr, phase = float(config["lr"]), config["phase"]
    torch.set_num_threads(max(1, cfg.cpus_per_trial))
    torch.manual_seed(cfg.seed)
    device = trial_device(cfg.gpus_per_trial)
    uri = config["mlflow_uri"]
    run_id = tracking.create_child_run(config["mlflow_parent"], f"{phase} lr={lr:g}", stage=f"finetune-{phase}",
                                       params={"lr": lr, "phase": phase, **config["cfg"]}, uri=uri)
    try:
        train_set = ShardSet(cfg.train)
        model = build_model(cfg, len(train_set.label_map)).to(device)
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
                         polyak=cfg.polyak, bf16=cfg.bf16, seed=cfg.seed)

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
        report_final(metrics, evaluated)
        tracking.end_run(run_id, uri=uri)
    except BaseException:
        tracking.end_run(run_id, failed=True, uri=uri)
        raise


# -- Tune sweeps that resume -----------------------------------------------------------------------

def tune_sweep(trainable, param_space: dict, *, name: str, output: Path, resources: dict, metric: str,
               max_concurrent: int = 0, max_failures: int = 0, label: tuple[str, ...] = ("lr",),
               prog: str = "finetune"):
    """Run a Tune sweep under ``output/ray/name``, or resume it if an interrupted one is there.

    A resumed sweep keeps its finished trials and runs the unfinished and errored ones again
    (``resume_errored``: they start from scratch, as a retry does). The console gets a line per
    trial event, trials named by the config keys in ``label`` (:mod:`training.tune_progress`).
    """
    from ray import tune

    from common.progress import TrialLines

    # Save the sweep's state after every event, not every 10 s or more: a sweep killed just after
    # a trial finished must not run that trial again on resume. The state is a few kB per trial.
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "0")
    storage = output / "ray"
    trainable = tune.with_resources(trainable, resources)
    if tune.Tuner.can_restore(str(storage / name)):
        tuner = tune.Tuner.restore(str(storage / name), trainable=trainable, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=param_space,
            tune_config=tune.TuneConfig(metric=metric, mode="max", max_concurrent_trials=max_concurrent or None),
            run_config=tune.RunConfig(name=name, storage_path=str(storage), verbose=0,
                                      callbacks=[TrialLines(f"{prog} {name}", label, metric)],
                                      failure_config=tune.FailureConfig(max_failures=max_failures)),
        )
    # Tune's current output engine prints its experiment box and a TensorBoard hint to stdout
    # even at verbose=0; the older one, which Tune reads this variable for, honours verbose=0.
    with _env("RAY_AIR_NEW_OUTPUT", None if progress.verbose() else "0"):
        return tuner.fit()


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """``os.environ[name] = value`` for the duration (None: leave it as it is)."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before


def open_sweep_state(output: Path, config: Mapping[str, Any], *, fresh_keys: Iterable[str] = ()) -> dict | None:
    """The state of an interrupted sweep in ``output`` (its MLflow run), or None for a new one.

    Resuming with a different configuration would mix trials of two sweeps; that is refused.
    """
    path = output / STATE_FILE
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    old = state.get("config", {})
    ignore = set(fresh_keys)
    changed = sorted(k for k in set(old) | set(config) if k not in ignore and old.get(k) != config.get(k))
    if changed:
        k = changed[0]
        raise ConfigError(
            f"output: {output} holds a sweep run with {k}={old.get(k)!r}, not {config.get(k)!r}"
            f"{' (and ' + ', '.join(changed[1:]) + ')' if changed[1:] else ''}; re-run with the same flags to "
            "resume it, or pass a new --output"
        )
    return state


def save_sweep_state(output: Path, config: Mapping[str, Any], run_id: str) -> None:
    from common.fs import atomic_write

    atomic_write(str(output / STATE_FILE), json.dumps({"config": dict(config), "mlflow_run_id": run_id},
                                                       indent=2, default=str))


def close_interrupted_children(run_id: str) -> int:
    """Mark the child runs an interrupted sweep left RUNNING as KILLED (their trials run again)."""
    import mlflow

    from common import tracking

    client = mlflow.MlflowClient(tracking.tracking_uri())
    parent = client.get_run(run_id)
    stale = client.search_runs([parent.info.experiment_id],
                               filter_string=f"tags.mlflow.parentRunId = '{run_id}' and attributes.status = 'RUNNING'")
    for r in stale:
        client.set_terminated(r.info.run_id, "KILLED")
    return len(stale)


def _resolve_inputs(cfg: FinetuneConfig) -> FinetuneConfig:
    from pipelines.schema import MANIFEST

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
        if name != "pretrained" and not (path / MANIFEST).is_file():
            raise ConfigError(f"{name}: {path} has no {MANIFEST}; produce it with jobs/prepare.py --output {path}")
        resolved[name] = str(path)
    return dataclasses.replace(cfg, **resolved)


def run_finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Select the learning rate on the dev sub-split, retrain on all of train at that rate, test it."""
    from common import tracking
    from common.fs import atomic_open, atomic_write, make_output_dir
    from common.jobenv import durable_path
    from pipelines.schema import ShardSet
    from training.data import split_rows
    from training.ray_utils import init_ray

    cfg = _resolve_inputs(cfg)
    train_set, test_set = ShardSet(cfg.train), ShardSet(cfg.test)
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
    output = Path(durable_path(cfg.output, "output")).expanduser().resolve()
    tracking.tracking_uri()  # refuses a store in Ray's uploaded copy before any trial runs
    config = dataclasses.asdict(cfg)
    # Where Ray runs and how many trials at once do not change the sweep's results.
    state = open_sweep_state(output, config, fresh_keys=not_recipe(cfg))
    make_output_dir(output)
    init_ray(cfg.ray_address)

    uri = tracking.tracking_uri()
    resources = {"cpu": cfg.cpus_per_trial, **({"gpu": cfg.gpus_per_trial} if cfg.gpus_per_trial else {})}
    from pipelines.schema import shard_set_record

    train_record = shard_set_record(cfg.train, role="training")
    records = [train_record, shard_set_record(cfg.test, role="evaluation")]
    upstream = [tracking.read_lineage(cfg.pretrained)] if cfg.pretrained else []
    upstream = [u for u in upstream if u]
    name = f"finetune {train_record['name']}" + (f" from {Path(cfg.pretrained).parent.name}" if cfg.pretrained else "")
    run_ctx = (tracking.start_run("finetune", run_id=state["mlflow_run_id"], log_system_metrics=True) if state else
               tracking.start_run("finetune", params=config, parent_run_id=cfg.parent_run_id, run_name=name,
                                  tags=tracking.run_tags(cfg, data=records, main=[train_record], models=upstream),
                                  log_system_metrics=True))
    with run_ctx as run:
        if state:
            close_interrupted_children(run.info.run_id)
        else:
            tracking.log_shard_inputs(records)
        save_sweep_state(output, config, run.info.run_id)
        common = {"cfg": config, "mlflow_parent": run.info.run_id, "mlflow_uri": uri}
        from ray import tune

        grid = tune_sweep(finetune_trial, {"lr": tune.grid_search(list(cfg.lrs)), "phase": "select", **common},
                          name="select", output=output, resources=resources, metric="val_accuracy",
                          max_concurrent=cfg.max_concurrent, max_failures=cfg.max_failures)
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
        best = max(rows, key=lambda r: r["val_accuracy"])
        final = tune_sweep(finetune_trial, {"lr": best["lr"], "phase": "final", **common}, name="final",
                           output=output, resources=resources, metric="test_accuracy",
                           max_failures=cfg.max_failures)
        result = final[0]
        if result.error or not result.metrics or "test_accuracy" not in result.metrics:
            raise RuntimeError(f"the final fine-tune at lr={best['lr']:g} on all of train failed: {result.error}")
        model_path = output / MODEL_FILE
        with result.checkpoint.as_directory() as d, open(Path(d) / MODEL_FILE, "rb") as src, \
                atomic_open(model_path) as dst:
            shutil.copyfileobj(src, dst)
        summary = {
            "trials": rows,
            "failed": failed,
            "dev_fraction": dev_fraction,
            "selected_lr": best["lr"],
            "selected_val_accuracy": best["val_accuracy"],
            "test_accuracy": result.metrics["test_accuracy"],
            "final_train_rows": result.metrics["train_rows"],
            "model": str(model_path),
            "mlflow_run_id": run.info.run_id,
        }
        tracking.log_metrics({"selected_lr": summary["selected_lr"],
                              "val_accuracy": summary["selected_val_accuracy"],
                              "test_accuracy": summary["test_accuracy"]})
        from training import run_artifacts

        tracking.set_tags({"mlflow.runName": f"{name} lr={best['lr']:g}"})
        grid_png = run_artifacts.finetune_grid(rows, best["lr"], summary["test_accuracy"],
                                               output / run_artifacts.FINETUNE_GRID, title=f"{name}: accuracy per learning rate")
        tracking.log_artifact(grid_png, "plots")
        tracking.write_lineage(output, run, "finetune")
        info = run_artifacts.log_vit_model(model_path, labels=train_set.label_names,
                                           metadata={"vitscale.finetune_run_id": run.info.run_id})
        summary["mlflow_model_uri"] = info.model_uri
        tracking.log_dict(summary, "finetune_summary.json")
        atomic_write(output / "finetune_summary.json", json.dumps(summary, indent=2))
    return summary
