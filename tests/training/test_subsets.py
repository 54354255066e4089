"""Nested subsets of a shard set (--fraction): the data-size axis of the paper's Figure 4."""
import os
import subprocess
import sys

import pytest

from common import tracking
from common.config import ConfigError, parse_args
from pipelines.schema import ShardSet
from training.data import DecodeBatch, holdout_mask, shard_keys, subset_mask, training_mask
from training.pretrain import PretrainConfig, run_pretrain

KEYS = [f"corpus/class{i % 7}/img{i:05d}.jpg" for i in range(5000)]
FRACTIONS = (0.03, 0.1, 0.3, 1.0)


def test_smaller_subsets_lie_inside_larger_ones_and_hold_their_share():
    masks = [subset_mask(KEYS, f) for f in FRACTIONS]
    for small, large in zip(masks, masks[1:]):
        assert not (small & ~large).any()
    for f, mask in zip(FRACTIONS, masks):
        assert abs(mask.mean() - f) < 0.02, (f, mask.mean())
    assert masks[-1].all()


def test_the_held_out_rows_are_the_same_at_every_fraction_and_in_no_subset():
    held = holdout_mask(KEYS, 0.1)
    for f in FRACTIONS:
        train = training_mask(KEYS, 0.1, f)
        assert not (train & held).any() and (train == (~held & subset_mask(KEYS, f))).all()
    assert (training_mask(KEYS, 0.1) == ~held).all()  # fraction 1 trains on every row, as before


def test_membership_is_the_same_in_another_process_whatever_its_string_hash_seed():
    code = ("import sys; from training.data import subset_mask; "
            "keys = [f'corpus/class{i % 7}/img{i:05d}.jpg' for i in range(5000)]; "
            "sys.stdout.write(''.join('1' if m else '0' for m in subset_mask(keys, 0.1)))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out == "".join("1" if m else "0" for m in subset_mask(KEYS, 0.1))


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_a_fraction_outside_zero_to_one_is_refused_in_one_line(value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(PretrainConfig, ["--data", "d", "--fraction", value], prog="pretrain")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "fraction: must be in (0, 1]" in err and len(err.strip().splitlines()) == 1


def test_the_ray_data_step_keeps_only_the_subset_of_the_training_rows(tiny_shards):
    ss = ShardSet(str(tiny_shards))
    batch = next(ss.iter_batches()).to_pydict()
    keys = [str(k) for k in batch["key"]]
    train = DecodeBatch(16, label_mode="single", num_classes=len(ss.label_map), holdout=0.2, fraction=0.5)(batch)
    expected = training_mask(keys, 0.2, 0.5)
    assert 0 < expected.sum() < len(keys) and len(train["label"]) == expected.sum()
    held = DecodeBatch(16, label_mode="single", num_classes=len(ss.label_map), holdout=0.2, fraction=0.5,
                       train=False)(batch)
    assert len(held["label"]) == holdout_mask(keys, 0.2).sum()


TINY = dict(variant="Ti/8", depth=1, img_size=32, num_workers=1, warmup_steps=1, holdout=0.1, epochs=1,
            batch_size=2, dropout=0.0, log_every=1)


def test_an_empty_subset_is_refused_before_ray_starts(tiny_shards, tmp_path, mlflow_store):
    with pytest.raises(ConfigError, match=r"^fraction: 1e-09 of .* selects no training rows .*raise --fraction"):
        run_pretrain(PretrainConfig(data=str(tiny_shards), output=str(tmp_path / "out"), fraction=1e-9, **TINY))
    assert not (tmp_path / "out").exists()


def test_a_run_trains_on_its_subset_and_records_its_size(tiny_shards, tmp_path, mlflow_store, ray_session):
    keys = shard_keys(ShardSet(str(tiny_shards)))
    rows = int(training_mask(keys, 0.1, 0.5).sum())
    assert 2 <= rows < int(training_mask(keys, 0.1).sum()) - 1
    summary = run_pretrain(PretrainConfig(data=str(tiny_shards), output=str(tmp_path / "half"), fraction=0.5, **TINY))
    assert summary["fraction"] == 0.5 and summary["train_rows"] == rows
    assert summary["steps"] == rows // 2  # one epoch of the worker's own dataset: the subset
    assert tracking.get_run(summary["mlflow_run_id"]).data.metrics["train_rows"] == rows
