"""Training-loop pieces shared by pre-training and fine-tuning: schedules, precision, updates, evaluation."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from training.losses import classification_loss


def lr_at(step: int, *, total: int, warmup: int, peak: float, schedule: str, end: float = 0.0) -> float:
    """Linear warm-up to ``peak`` then linear or cosine decay to ``end`` at ``total`` steps."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * progress))
    return peak + (end - peak) * progress


def effective_warmup(requested: int, total_steps: int) -> int:
    # A short run with the paper's 10k warm-up steps would never leave warm-up.
    return min(requested, max(1, total_steps // 10))


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast on GPU (Hopper/Ampere tensor cores); CPU runs stay fp32."""
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The bare module under torch.compile's and DDP's wrappers."""
    while True:
        inner = getattr(module, "_orig_mod", None) or getattr(module, "module", None)
        if inner is None:
            return module
        module = inner


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum across data-parallel workers; the identity outside a process group."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Every group's rate: ``lr``, times the group's ``lr_scale`` where it has one (layer-wise decay)."""
    for group in opt.param_groups:
        group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr


def grad_sync(model: torch.nn.Module, enabled: bool):
    """Gradient all-reduce on (``enabled``) or off for the next backward: DDP's ``no_sync`` or
    FSDP2's ``set_requires_gradient_sync``; a no-op for an unwrapped model."""
    seen = model
    while seen is not None:
        if hasattr(seen, "set_requires_gradient_sync"):  # FSDP2 (fully_shard)
            seen.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        if hasattr(seen, "no_sync"):  # DistributedDataParallel
            return contextlib.nullcontext() if enabled else seen.no_sync()
        seen = getattr(seen, "_orig_mod", None)  # under torch.compile
    return contextlib.nullcontext()


def accumulate_step(model: torch.nn.Module, opt: torch.optim.Optimizer, microbatches, loss_fn, *,
                    count: int, grad_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimiser step over ``count`` equal micro-batches, the same update as one step on
    their union: each mean loss is scaled by 1/count, and gradients are all-reduced only on the
    last backward. The paper clips the global norm at 1 for every run (``grad_clip`` 0: no clip).
    Returns (mean loss, global gradient norm before clipping) as 0-d tensors on the device, so
    that a GPU step does not wait for the host."""
    opt.zero_grad(set_to_none=True)
    total = None
    for i, batch in enumerate(microbatches):
        with grad_sync(model, i == count - 1):
            loss = loss_fn(batch) / count
            loss.backward()
        total = loss.detach().float() if total is None else total + loss.detach().float()
    grad_sync(model, True)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip else float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    opt.step()
    return total, norm.detach()


def evaluate(model: torch.nn.Module, batches, device: torch.device, bf16: bool) -> dict[str, float]:
    """Mean loss and top-1 accuracy over ``batches``, summed over every data-parallel worker."""
    was_training = model.training
    model.eval()
    n = loss_sum = correct = 0.0
    with torch.no_grad():
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            with autocast(device, bf16):
                logits = model(x)
            loss, right = classification_loss(logits, y)
            loss_sum, correct, n = loss_sum + float(loss), correct + float(right), n + x.shape[0]
    n, loss_sum, correct = all_reduce_sum([n, loss_sum, correct], device)
    model.train(was_training)
    return {"n": n, "loss": loss_sum / max(1, n), "accuracy": correct / max(1, n)}
