"""The pre-training checkpointer's own decisions: when a save is due, and the data position it saves."""
import numpy as np

from training.checkpointer import Checkpointer, DataPosition
from training.pretrain import PretrainConfig


def saves(steps_per_epoch: int, total_steps: int, **cfg) -> list[int]:
    """The steps a run of ``total_steps`` checkpoints after, walking its epochs as the trainer does."""
    ckpt = Checkpointer(PretrainConfig(data="shards", **cfg), steps_per_epoch=steps_per_epoch, total_steps=total_steps)
    return [step for step in range(1, ckpt.last_step + 1)
            if ckpt.due(step, offset=(step - 1) % steps_per_epoch + 1)]


def test_a_save_is_due_at_each_epoch_end_and_at_the_last_step_by_default():
    assert saves(4, 10) == [4, 8, 10]


def test_checkpoint_every_replaces_the_epoch_ends():
    assert saves(4, 10, checkpoint_every=3) == [3, 6, 9, 10]


def test_stop_after_ends_the_submission_with_a_save():
    assert saves(4, 10, stop_after=6) == [4, 6]
    assert saves(4, 10, checkpoint_every=5, stop_after=7) == [5, 7]
    assert Checkpointer(PretrainConfig(data="shards", stop_after=50), steps_per_epoch=4, total_steps=10).last_step == 10


def test_a_finished_epoch_is_saved_as_the_start_of_the_next():
    pos = DataPosition(steps_per_epoch=2)
    pos.advance(np.array([3.0, 5.0]))
    assert pos.state_dict([2.0, 8.0, 34.0]) == {"epoch": 0, "offset": 1, "rows_seen": [2.0, 8.0, 34.0]}
    pos.advance(np.array([1.0, 2.0]))
    assert pos.epoch_done
    assert pos.state_dict([4.0, 11.0, 39.0]) == {"epoch": 1, "offset": 0, "rows_seen": [0.0, 0.0, 0.0]}
