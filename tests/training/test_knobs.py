"""The regularization knobs of pre-training: each is part of the recipe, off by default, and a bad
value is refused in one line naming its flag."""
import dataclasses

import pytest

from common import tracking
from common.config import ConfigError, free_on_resume, not_recipe, off_values, parse_args
from training.checkpointer import check_resumable
from training.pretrain import PretrainConfig

KNOBS = ("label_smoothing", "drop_path")


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
])
def test_bad_knob_values_are_refused_in_one_line_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(PretrainConfig, ["--data", "d", *argv], prog="pretrain")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
