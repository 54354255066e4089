"""Polyak averaging of a model's weights: the exponential moving average that the paper's ImageNet
fine-tunes report with 0.9999, and that DeiT keeps in pre-training (``--ema-decay``).

Pre-training and fine-tuning share this one averager; its state is a plain state dict, so a
pre-training checkpoint carries it and a resume continues the average exactly.
"""
from __future__ import annotations

import copy

import torch


class Polyak:
    """Exponential moving average of a model's weights (Polyak & Juditsky averaging).

    The decay ramps up as ``min(decay, (1 + n) / (10 + n))`` after n updates (TensorFlow's
    ExponentialMovingAverage with ``num_updates``): with a constant 0.9999 a 500-step run would
    report weights that are still 95% the initial ones.
    """

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.updates = 0
        self.model = copy.deepcopy(model).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    def update(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            d = min(self.decay, (1 + self.updates) / (10 + self.updates))
            for avg, p in zip(self.model.parameters(), model.parameters()):
                avg.lerp_(p.detach(), 1.0 - d)
            for avg, b in zip(self.model.buffers(), model.buffers()):
                avg.copy_(b)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()}, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.updates = int(state["updates"])
