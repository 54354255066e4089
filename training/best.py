"""The best few-shot score of a pre-training run, its step, and that step's model.

Section 4.3 reports "the best validation accuracy achieved during training" (early stopping);
with ``--fewshot-every`` the run keeps the few-shot scores' best, per shot count, and the model
of the step whose mean over the scored shot counts is highest, as :data:`BEST_MODEL_FILE`
beside the final model. It travels with each checkpoint, so a resumed run keeps it.
"""
from __future__ import annotations

from pathlib import Path

import torch

import vitcore
from vitcore.checkpoint import label_metadata

BEST_MODEL_FILE = "best_model.safetensors"
PREFIX = "best_fewshot_"


class BestFewshot:
    """The best of the few-shot scores seen so far (``fewshot_<k>shot_accuracy``, at steps).

    Per score: its best value and the first step that reached it. The model kept is that of the
    first step with the highest mean over the scores (:attr:`step`)."""

    def __init__(self) -> None:
        self.scores: dict[str, tuple[float, int]] = {}
        self.mean: float | None = None
        self.step: int | None = None
        self.model: torch.nn.Module | None = None  # rank 0's copy of the published model at ``step``

    def update(self, scores: dict[str, float], step: int) -> bool:
        """Take the scores of ``step``; True when their mean is a new best (the caller keeps the model)."""
        for name, value in scores.items():
            if name not in self.scores or value > self.scores[name][0]:
                self.scores[name] = (float(value), step)
        mean = sum(scores.values()) / len(scores)
        if self.mean is not None and mean <= self.mean:
            return False
        self.mean, self.step = float(mean), step
        return True

    def metrics(self) -> dict[str, float]:
        """``best_fewshot_<k>shot_accuracy`` and ``..._step`` per score, the mean's best and its step."""
        if self.step is None:
            return {}
        out: dict[str, float] = {}
        for name, (value, step) in sorted(self.scores.items()):
            short = name.removeprefix("fewshot_")
            out[PREFIX + short] = value
            out[PREFIX + short.removesuffix("_accuracy") + "_step"] = step
        out[PREFIX + "mean_accuracy"], out[PREFIX + "step"] = self.mean, self.step
        return out

    def state_dict(self) -> dict:
        return {"scores": {k: [v, s] for k, (v, s) in self.scores.items()}, "mean": self.mean, "step": self.step}

    def load_state_dict(self, state: dict | None, folder: Path, *, rank: int) -> None:
        """The record a checkpoint holds (none in one written before it was kept), and on rank 0 the model."""
        if not state or state.get("step") is None:
            return
        self.scores = {k: (float(v), int(s)) for k, (v, s) in state["scores"].items()}
        self.mean, self.step = float(state["mean"]), int(state["step"])
        if rank == 0:
            self.model = vitcore.load_checkpoint(folder / BEST_MODEL_FILE)

    def save_model(self, folder: Path, label_names: list[str]) -> list[str]:
        """The kept model into a checkpoint folder (rank 0); the names of the files written."""
        if self.model is None:
            return []
        vitcore.save_checkpoint(self.model, folder / BEST_MODEL_FILE, extra_metadata=label_metadata(label_names))
        return [BEST_MODEL_FILE]


def summary_record(metrics: dict) -> dict | None:
    """The summary's ``best_fewshot`` entry from a run's reported metrics; None without few-shot scores."""
    if PREFIX + "step" not in metrics:
        return None
    shots = {k[len(PREFIX):]: metrics[k] for k in sorted(metrics)
             if k.startswith(PREFIX) and k not in (PREFIX + "step", PREFIX + "mean_accuracy")}
    return {"step": int(metrics[PREFIX + "step"]), "mean_accuracy": metrics[PREFIX + "mean_accuracy"],
            **{k: int(v) if k.endswith("_step") else v for k, v in shots.items()}}
