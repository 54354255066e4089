"""The pre-training step's options: how the model is compiled and which AdamW kernel updates it.

The trainer and ``benchmarks/gpu_pretrain.py`` build the step from here, so that the benchmark
times what a run trains with. Nothing here imports Ray: a GPU image without it can run the benchmark.
"""
from __future__ import annotations

from typing import Literal

import torch

#: ``--compile``: ``eager`` runs the model as written; the others are ``torch.compile`` modes
#: (``reduce-overhead`` adds CUDA graphs, ``max-autotune`` adds kernel autotuning and CUDA graphs).
CompileOption = Literal["auto", "eager", "default", "reduce-overhead", "max-autotune"]


def compile_mode(option: str, device_type: str) -> str | None:
    """The ``torch.compile`` mode that ``option`` means on a ``device_type`` worker; None: eager.

    ``auto`` compiles on CUDA, where ``benchmarks/README.md`` measures the compiled step faster, and
    stays eager on CPU, where compiling costs minutes of a short run and the demo's figures are eager.
    """
    if option == "auto":
        return "default" if device_type == "cuda" else None
    if option == "eager":
        return None
    if option not in ("default", "reduce-overhead", "max-autotune"):
        raise ValueError(f"compile option {option!r}: use one of auto, eager, default, reduce-overhead, max-autotune")
    return option


def compile_model(module: torch.nn.Module, mode: str | None) -> torch.nn.Module:
    """``module`` compiled with ``mode``, or itself when ``mode`` is None."""
    return module if mode is None else torch.compile(module, mode=mode)


def adamw(model: torch.nn.Module, *, lr: float, weight_decay: float, fused: bool = False) -> torch.optim.AdamW:
    """Adam with decoupled weight decay (Appendix B.1), none on biases, norms and embeddings.

    ``fused``: one multi-tensor kernel per step instead of torch's default implementation
    (CPU and CUDA); the same update up to floating-point order.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "pos_embed" in name or "cls_token" in name else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.999), fused=fused or None,
    )
