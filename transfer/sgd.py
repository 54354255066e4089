"""SGD fine-tuning, shared by fine-tuning and VTAB: the paper's recipe (Section 3.2, Appendix B.1.1).

The model starts from the pre-trained one with its whole head replaced by one zero-initialised
linear layer (position embeddings interpolated to the fine-tuning resolution), and trains with
SGD with momentum 0.9, no weight decay, global-norm clipping at 1, a short warm-up then cosine
decay. The batch (512 in the paper) fits any device: ``microbatch`` images go through the model
at once and their gradients accumulate into one step (:func:`training.loop.accumulate_step`).
Polyak averaging, which the paper's ImageNet results use, is optional, and so is layer-wise
learning-rate decay (BEiT, timm's fine-tuning): lower layers move less than the head.

torch and vitcore are imported where they are used: the stages' configs check their batching
here, and a ``--help`` or a refused flag should not wait for torch to load.
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from common.config import ConfigError, check


def check_batching(batch_size: int, microbatch: int) -> None:
    check(microbatch >= 0, "microbatch", f"must be >= 0, got {microbatch}")
    check(microbatch == 0 or batch_size % microbatch == 0, "microbatch",
          f"--batch-size {batch_size} must be a multiple of --microbatch {microbatch}")


def pretrained_file(value: str) -> Path:
    """The pre-trained model a ``--pretrained`` names: the file, or ``MODEL_FILE`` in the folder."""
    from vitcore.checkpoint import MODEL_FILE, CheckpointMismatch, check_checkpoint

    path = Path(value).expanduser().resolve()
    if path.is_dir():
        path = path / MODEL_FILE
    if not path.is_file():
        raise ConfigError(f"pretrained: {path} does not exist; pass the {MODEL_FILE} that jobs/pretrain.py wrote")
    # From the header, before Ray starts: a bad file would otherwise fail every trial, retries included.
    try:
        check_checkpoint(path)
    except (CheckpointMismatch, FileNotFoundError) as exc:
        raise ConfigError(f"pretrained: {_one_line(exc)} (expected the {MODEL_FILE} that jobs/pretrain.py or "
                          "vitcore.save_checkpoint writes)") from None
    check_recorded_sha256(path)
    return path


def check_recorded_sha256(path: Path) -> None:
    """Refuse a model file whose bytes differ from the sha256 a record beside it holds: pre-training's
    summary, or the ``checkpoint.json`` of the checkpoint folder it sits in. A file with neither passes."""
    from training.checkpointer import RECORD, sha256_of
    from training.pretrain import SUMMARY

    for name in (SUMMARY, RECORD):
        try:
            recorded = json.loads((path.parent / name).read_text())["sha256"][path.name]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        actual = sha256_of(path)
        if actual != recorded:
            raise ConfigError(f"pretrained: {path} does not match the sha256 {path.parent / name} records for it "
                              f"(record {str(recorded)[:12]}…, file {actual[:12]}…); copy the file again from where "
                              "pretrain wrote it, or re-run pretrain")
        return


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def load_backbone(pretrained: str | None, variant: str, img_size: int | None, num_classes: int):
    """A pre-trained model (position embeddings interpolated to ``img_size``) with the whole head
    replaced by one zero-initialised linear layer; or ``variant`` from scratch."""
    import vitcore

    if pretrained:
        model = vitcore.load_checkpoint(pretrained, **({"img_size": img_size} if img_size else {}))
    else:
        model = vitcore.create_model(variant, num_classes=num_classes, img_size=img_size or 224)
    return vitcore.reset_head(model, num_classes)


def start_trial(cpus_per_trial: int, gpus_per_trial: float, seed: int):
    """A Tune trial's torch threads (its CPUs) and seed; returns its device."""
    import torch

    from training.ray_utils import mute_dropped_exits

    mute_dropped_exits()

    torch.set_num_threads(max(1, cpus_per_trial))
    torch.manual_seed(seed)
    return torch.device("cuda" if gpus_per_trial and torch.cuda.is_available() else "cpu")


def layer_ids(model) -> tuple[dict[str, int], int]:
    """Each parameter's layer for layer-wise learning-rate decay, and the top layer L.

    As BEiT and timm count them: the embedding (a ViT's patch embedding, class token and position
    embeddings; a ResNet's stem) is layer 0, encoder block i (a ResNet's i-th bottleneck unit,
    counted across stages) is layer i + 1, and what follows the last block (the final norm, the
    pre-logits and the head) is layer L = blocks + 1.
    """
    names = [name for name, _ in model.named_parameters()]
    units = sorted({m.group(0) for n in names if (m := _UNIT.match(n))}, key=_unit_order)
    unit_of = {u: i + 1 for i, u in enumerate(units)}
    top = len(units) + 1
    ids = {}
    for name in names:
        unit = _UNIT.match(name)
        ids[name] = unit_of[unit.group(0)] if unit else 0 if name.startswith(_EMBEDDING) else top
    return ids, top


_UNIT = re.compile(r"^(blocks\.\d+|stages\.\d+\.blocks\.\d+)\.")
_EMBEDDING = ("patch_embed.", "cls_token", "pos_embed", "stem.")


def _unit_order(unit: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", unit))


def sgd_param_groups(model, layer_decay: float | None) -> Any:
    """The optimiser's parameters: all in one group, or with ``layer_decay`` one group per layer
    whose rate is the base rate x decay^(L - layer) (:func:`layer_ids`); ``set_lr`` applies the scale."""
    if not layer_decay:
        return model.parameters()
    ids, top = layer_ids(model)
    groups: dict[int, list] = {}
    for name, p in model.named_parameters():
        groups.setdefault(ids[name], []).append(p)
    return [{"params": ps, "lr_scale": layer_decay ** (top - layer), "layer": layer}
            for layer, ps in sorted(groups.items())]


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
    layer_decay: float | None = None
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
    import torch.nn.functional as F

    from training.ema import Polyak
    from training.loop import accumulate_step, autocast, effective_warmup, lr_at, set_lr

    batch = min(spec.batch_size, len(train_ds))
    micro = min(spec.microbatch or batch, batch)
    per_step = max(1, batch // micro)
    batch = per_step * micro
    stream = microbatch_stream(train_ds, micro, spec.seed)
    opt = torch.optim.SGD(sgd_param_groups(model, spec.layer_decay), lr=spec.lr, momentum=spec.momentum,
                          weight_decay=0.0)
    warmup = effective_warmup(spec.warmup_steps, spec.steps)
    avg = Polyak(model, spec.polyak) if spec.polyak else None

    def loss_of(microbatch):
        x, y = microbatch[0].to(device), microbatch[1].to(device)
        with autocast(device, spec.bf16):
            logits = model(x)
        return F.cross_entropy(logits.float(), y)

    model.train()
    t0 = time.perf_counter()
    loss = float("nan")
    for step in range(spec.steps):
        set_lr(opt, lr_at(step, total=spec.steps, warmup=warmup, peak=spec.lr, schedule="cosine"))
        loss, _ = accumulate_step(model, opt, (next(stream) for _ in range(per_step)), loss_of, count=per_step,
                                  grad_clip=spec.grad_clip)
        loss = float(loss)
        if avg is not None:
            avg.update(model)
        if on_eval and eval_every and (step + 1) % eval_every == 0 and step + 1 < spec.steps:
            on_eval(avg.model if avg else model, step + 1, loss)
    stats = {"train_loss": loss, "images_per_second": spec.steps * batch / (time.perf_counter() - t0),
             "batch_size": batch, "microbatch": micro}
    return (avg.model if avg else model), stats
