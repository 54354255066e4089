"""The regularization knobs of pre-training: each is part of the recipe, off by default, and a bad
value is refused in one line naming its flag."""
import dataclasses

import numpy as np
import pytest
import torch

import vitcore
from common import tracking
from common.config import ConfigError, free_on_resume, not_recipe, off_values, parse_args
from training.checkpointer import check_resumable
from training.pretrain import PretrainConfig, run_pretrain

KNOBS = ("label_smoothing", "drop_path", "mixup", "cutmix", "mixup_switch_prob", "ema_decay", "randaug", "classifier",
         "posemb", "fraction")


def test_knobs_at_their_defaults_leave_the_hash_and_old_checkpoints_as_they_were():
    cfg = PretrainConfig(data="d")
    record = dataclasses.asdict(cfg)
    before = {k: v for k, v in record.items() if k not in KNOBS}  # a config recorded before the knobs
    hashed_before = {k: v for k, v in before.items() if k not in not_recipe(cfg)}
    assert tracking.config_hash(cfg) == tracking.config_hash(hashed_before)
    check_resumable(before, record, free_on_resume(cfg), off_values(cfg))
    smoothed = PretrainConfig(data="d", label_smoothing=0.1)
    assert tracking.config_hash(smoothed) != tracking.config_hash(cfg)
    with pytest.raises(ConfigError, match="label_smoothing: checkpoint None, now 0.1"):
        check_resumable(before, dataclasses.asdict(smoothed), free_on_resume(cfg), off_values(cfg))


@pytest.mark.parametrize("argv, message", [
    (["--label-smoothing", "-0.1"], "label_smoothing: must be in [0, 1)"),
    (["--label-smoothing", "0.1", "--loss", "sigmoid"], "label_smoothing: applies to the softmax"),
    (["--label-smoothing", "0.1", "--objective", "mpp"], "label_smoothing: applies to the softmax"),
    (["--drop-path", "1.0"], "drop_path: must be in [0, 1)"),
    (["--drop-path", "0.1", "--variant", "BiT-R50x1"], "drop_path: BiT-R50x1 is a BiT ResNet"),
    (["--mixup", "-0.2"], "mixup: must be >= 0"),
    (["--ema-decay", "1"], "ema_decay: must be in [0, 1)"),
    (["--ema-decay", "0.999", "--strategy", "fsdp"], "ema_decay: an averaged copy of an FSDP-sharded model"),
    (["--cutmix", "1", "--objective", "mpp"], "cutmix: mixes class targets"),
    (["--mixup", "0", "--cutmix", "0", "--mixup-switch-prob", "0.5"], "mixup_switch_prob: picks between Mixup and CutMix"),
    (["--mixup", "0.8", "--cutmix", "1", "--mixup-switch-prob", "1.5"], "mixup_switch_prob: must be in [0, 1]"),
])
def test_bad_knob_values_are_refused_in_one_line_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(PretrainConfig, ["--data", "d", *argv], prog="pretrain")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


TINY = dict(variant="Ti/8", depth=2, img_size=32, num_workers=1, warmup_steps=2, holdout=0.1, log_every=2,
            steps=4, batch_size=8, microbatch=4, dropout=0.1, checkpoint_every=2)
ALL_KNOBS = dict(label_smoothing=0.1, drop_path=0.2, mixup=0.8, cutmix=1.0, ema_decay=0.9)




def _weights(summary):
    return vitcore.load_checkpoint(summary["model"]).state_dict()


def test_a_run_with_every_knob_cut_and_resumed_trains_to_the_end(photo_shards, tmp_path):
    """Mixup/CutMix, stochastic depth, the smoothed loss and the weight average through real Ray
    workers: the run is cut at step 2, the same command finishes it from the checkpoint (the
    average included), and the model file holds the average, not the last weights."""
    cut = dict(data=photo_shards, output=str(tmp_path / "r"), run_name="r", **ALL_KNOBS, **TINY)
    assert run_pretrain(PretrainConfig(stop_after=2, **cut))["steps"] == 2
    resumed = run_pretrain(PretrainConfig(**cut))
    assert resumed["steps"] == 4 and np.isfinite(resumed["metrics"]["train_loss"])
    states = [torch.load(f, map_location="cpu", weights_only=True) for f in (tmp_path / "r").rglob("train_state.pt")]
    state = max(states, key=lambda st: st["step"])
    assert state["ema"]["updates"] == 4
    saved = _weights(resumed)
    for name, avg in state["ema"]["model"].items():
        assert torch.equal(saved[name], avg), name
    assert not torch.equal(saved["head.weight"], state["model"]["head.weight"])

