"""Early stopping in pre-training (Section 4.3): the best few-shot score, its step and that step's
model, kept through a cut and a resume, and scored on the averaged weights when EMA is on."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import vitcore
from common import tracking
from training.best import BestFewshot
from training.pretrain import PretrainConfig, run_pretrain
from training.trainer import _fewshot_scores, _fewshot_set

TINY = dict(variant="Ti/8", depth=1, img_size=32, num_workers=1, warmup_steps=2, holdout=0.1, log_every=2,
            batch_size=8, microbatch=8, lr=3e-3, fewshot_every=1, checkpoint_every=1, keep_checkpoints=10)




def _checkpoints(output: Path, run_name: str) -> dict[int, Path]:
    """Each step's checkpoint folder of a run (checkpoint_every=1, all kept)."""
    folders = (output / "ray" / run_name).glob("checkpoint_*")
    return {json.loads((f / "checkpoint.json").read_text())["step"]: f for f in folders if f.is_dir()}


def _history(*run_ids: str) -> dict[str, dict[int, float]]:
    """Each few-shot score by step, over the runs a cut run logged to (a stop_after submission finishes its run)."""
    out: dict[str, dict[int, float]] = {}
    for run_id in run_ids:
        names = [k for k in tracking.get_run(run_id).data.metrics if k.startswith("fewshot_")]
        for name, points in tracking.metric_history(run_id, names).items():
            out.setdefault(name, {}).update(dict(points))
    return out


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def test_the_best_step_is_the_highest_recorded_score_and_survives_a_resume(photo_shards, tmp_path):
    out = tmp_path / "run"
    cfg = dict(data=photo_shards, fewshot_data=photo_shards, output=str(out), run_name="r", steps=6, **TINY)
    first = run_pretrain(PretrainConfig(stop_after=3, **cfg))
    assert first["steps"] == 3 and first["best_fewshot"]["step"] <= 3
    summary = run_pretrain(PretrainConfig(**cfg))
    assert summary["steps"] == 6

    history = _history(first["mlflow_run_id"], summary["mlflow_run_id"])
    assert history and all(sorted(h) == [1, 2, 3, 4, 5, 6] for h in history.values()), history
    steps = sorted(next(iter(history.values())))
    means = [np.mean([h[s] for h in history.values()]) for s in steps]
    best = summary["best_fewshot"]
    assert best["step"] == steps[int(np.argmax(means))]  # the first step reaching the highest mean
    for name, h in history.items():
        short = name.removeprefix("fewshot_").removesuffix("_accuracy")
        assert best[f"{short}_accuracy"] == max(h.values())
        assert best[f"{short}_step"] == min(s for s, v in h.items() if v == max(h.values()))
    logged = tracking.get_run(summary["mlflow_run_id"]).data.metrics
    assert logged["best_fewshot_step"] == best["step"] and logged["best_fewshot_mean_accuracy"] == best["mean_accuracy"]

    # The best model sits beside the final one, in the same format, with the weights of its step.
    assert Path(best["model"]).parent == Path(summary["model"]).parent
    kept = vitcore.load_checkpoint(best["model"]).state_dict()
    at_step = vitcore.load_checkpoint(_checkpoints(out, "r")[best["step"]] / "model.safetensors").state_dict()
    _assert_same_weights(kept, at_step)
    assert vitcore.read_checkpoint(best["model"])[2] == vitcore.read_checkpoint(summary["model"])[2]  # labels too
    # The summary holds both files' sha256: the stages given one as --pretrained check it.
    from training.checkpointer import sha256_of

    assert summary["sha256"] == {Path(m).name: sha256_of(Path(m)) for m in (summary["model"], best["model"])}

    # Scoring, keeping the best and checkpointing leave training as it was (dropout's random stream
    # included): the same run without scoring, never cut, ends on the same weights as the cut one.
    plain = {**{k: v for k, v in cfg.items() if k not in ("fewshot_every", "fewshot_data")},
             "output": str(tmp_path / "plain"), "run_name": "p"}
    assert PretrainConfig(**plain).dropout > 0
    unscored = run_pretrain(PretrainConfig(**plain))
    assert "best_fewshot" not in unscored and not (tmp_path / "plain" / "best_model.safetensors").exists()
    _assert_same_weights(vitcore.load_checkpoint(summary["model"]).state_dict(),
                         vitcore.load_checkpoint(unscored["model"]).state_dict())


def test_with_ema_the_scores_and_the_best_model_are_the_averaged_weights(photo_shards, tmp_path):
    out = tmp_path / "ema"
    cfg = PretrainConfig(data=photo_shards, fewshot_data=photo_shards, output=str(out), run_name="e", steps=4,
                         ema_decay=0.9, **TINY)
    summary = run_pretrain(cfg)
    folders = _checkpoints(out, "e")
    fewshot = _fewshot_set(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the worker scored (cpus_per_worker=1)
    try:
        for step, values in _history_by_step(summary["mlflow_run_id"]).items():
            averaged = vitcore.load_checkpoint(folders[step] / "model.safetensors")  # the published (EMA) model
            assert _fewshot_scores(averaged, fewshot, cfg.microbatch_size) == pytest.approx(values, abs=1e-6), step
    finally:
        torch.set_num_threads(threads)
    state = torch.load(folders[summary["best_fewshot"]["step"]] / "train_state.pt", map_location="cpu",
                       weights_only=True)
    kept = vitcore.load_checkpoint(summary["best_fewshot"]["model"]).state_dict()
    _assert_same_weights(kept, state["ema"]["model"])
    assert not torch.equal(kept["head.weight"], state["model"]["head.weight"])


def _history_by_step(run_id: str) -> dict[int, dict[str, float]]:
    by_step: dict[int, dict[str, float]] = {}
    for name, h in _history(run_id).items():
        for step, value in h.items():
            by_step.setdefault(step, {})[name] = value
    return by_step


def test_a_tie_keeps_the_first_step_and_the_state_round_trips():
    best = BestFewshot()
    assert best.update({"fewshot_1shot_accuracy": 0.5, "fewshot_5shot_accuracy": 0.6}, 2)
    assert not best.update({"fewshot_1shot_accuracy": 0.6, "fewshot_5shot_accuracy": 0.5}, 4)
    assert best.metrics() == {"best_fewshot_1shot_accuracy": 0.6, "best_fewshot_1shot_step": 4,
                              "best_fewshot_5shot_accuracy": 0.6, "best_fewshot_5shot_step": 2,
                              "best_fewshot_mean_accuracy": 0.55, "best_fewshot_step": 2}
    again = BestFewshot()
    again.load_state_dict(best.state_dict(), Path("unused"), rank=1)  # rank 1 keeps no model
    assert again.metrics() == best.metrics() and again.model is None
