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


def test_the_newest_complete_checkpoint_is_found_and_folders_no_one_reads_are_removed(tmp_path):
    import json

    from training.checkpointer import RECORD, newest_checkpoint, scan_run

    def folder(name, step, *, torn=False, record=True):
        d = tmp_path / name
        d.mkdir()
        (d / "train_state.pt").write_bytes(b"x" * (5 if torn else 10))
        if record:
            (d / RECORD).write_text(json.dumps({"step": step, "files": {"train_state.pt": 10}, "cfg": {}}))
        return d

    folder("checkpoint_1", 5)  # in Ray's snapshot: Ray evicts it, not us
    folder("checkpoint_2", 10)  # complete, but older than the newest and unknown to Ray: an orphan
    newest = folder("checkpoint_3", 15)
    folder("checkpoint_4", 20, torn=True)  # cut short: its state is not the size its record says
    folder("checkpoint_5", 25, record=False)  # its record never arrived
    assert newest_checkpoint(tmp_path)[0] == newest  # what an interrupted run says it kept
    found, record, removed, _ = scan_run(tmp_path, known=["checkpoint_1"])
    assert found == newest and record["step"] == 15
    assert sorted(p.name for p in removed) == ["checkpoint_2", "checkpoint_4", "checkpoint_5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1", "checkpoint_3"]
    assert scan_run(tmp_path / "no_run", known=[]) == (None, None, [], [])


def test_a_checkpoint_whose_bytes_changed_is_passed_over_for_the_one_before(tmp_path):
    import hashlib
    import json

    import pytest

    from common.config import ConfigError
    from training.checkpointer import RECORD, scan_run

    def folder(name, step, *, digest=True):
        d = tmp_path / name
        d.mkdir()
        (d / "train_state.pt").write_bytes(b"x" * 10)
        record = {"step": step, "files": {"train_state.pt": 10}, "cfg": {}}
        if digest:
            record["sha256"] = {"train_state.pt": hashlib.sha256(b"x" * 10).hexdigest()}
        (d / RECORD).write_text(json.dumps(record))
        return d

    old = folder("checkpoint_1", 5, digest=False)  # written before records carried digests: sizes only
    good = folder("checkpoint_2", 10)
    bad = folder("checkpoint_3", 15)
    (bad / "train_state.pt").write_bytes(b"y" * 10)  # same size, other bytes
    scan = scan_run(tmp_path, known=["checkpoint_1", "checkpoint_2", "checkpoint_3"], verify=True)
    assert (scan.folder, scan.corrupt) == (good, [bad])
    (good / "train_state.pt").write_bytes(b"y" * 10)
    assert scan_run(tmp_path, known=[], verify=True)[:2] == (old, json.loads((old / RECORD).read_text()))
    assert bad.is_dir() and good.is_dir()  # kept for their owner to look at
    (old / "train_state.pt").unlink()
    with pytest.raises(ConfigError, match=r"no checkpoint of run .* matches the sha256 .*checkpoint_3, .*checkpoint_2"):
        scan_run(tmp_path, known=[], verify=True)


def _restore_on_rank(rank: int, tmp: str) -> None:
    """One of two gloo ranks: save a trained state (rank 0), then restore it into other weights."""
    import dataclasses
    import json
    from pathlib import Path

    import ray.train
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.nn.parallel import DistributedDataParallel

    import vitcore
    from training.best import BestFewshot
    from training.checkpointer import STATE_FORMAT, TRAIN_STATE
    from training.ema import Polyak
    from training.step import adamw
    from training.trainer import Trainer

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    cfg = PretrainConfig(data="shards", variant="Ti/8", depth=1, img_size=32, ema_decay=0.9)
    whole = StateDictOptions(full_state_dict=True)

    def build(seed):
        torch.manual_seed(seed)
        model = vitcore.create_model("Ti/8", num_classes=3, img_size=32, depth=1)
        ddp = DistributedDataParallel(model)
        return model, ddp, adamw(ddp, lr=1e-3, weight_decay=0.05, fused=False)

    model, ddp, opt = build(1)
    ddp(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()
    ema = Polyak(model, 0.9)
    ema.update(model)
    saved = {"model": get_model_state_dict(ddp, options=whole), "optimizer": get_optimizer_state_dict(ddp, opt, options=whole)}
    rng = [torch.manual_seed(100 + r).get_state() for r in range(2)]
    folder = Path(tmp) / "checkpoint_000003"
    if rank == 0:
        folder.mkdir()
        torch.save({"format": STATE_FORMAT, **saved, "step": 3, "ema": ema.state_dict(), "epoch": 1, "offset": 2,
                    "rows_seen": [4.0, 10.0, 30.0], "rng": {"cpu": rng}, "best_fewshot": None,
                    "cfg": dataclasses.asdict(cfg)}, folder / TRAIN_STATE)
    dist.barrier()

    target, ddp, opt = build(2)
    trainer = Trainer.__new__(Trainer)
    trainer.__dict__.update(cfg=cfg, rank=rank, world=2, device=torch.device("cpu"), dist_model=ddp, opt=opt,
                            ema=Polyak(target, 0.9), best=BestFewshot(), position=DataPosition(4), step=0, run={})
    # Rank 1 is handed a folder that does not exist: it must read nothing, and take all from rank 0.
    where = folder if rank == 0 else Path(tmp) / "only-rank-0-reads"
    Checkpointer(cfg, steps_per_epoch=4, total_steps=10, rank=rank, world=2).restore(trainer, ray.train.Checkpoint(str(where)))
    restored = {"model": get_model_state_dict(ddp, options=whole), "optimizer": get_optimizer_state_dict(ddp, opt, options=whole)}
    torch.testing.assert_close(restored["model"], saved["model"], rtol=0, atol=0)
    torch.testing.assert_close(restored["optimizer"]["state"], saved["optimizer"]["state"], rtol=0, atol=0)
    groups = [json.loads(json.dumps(d["optimizer"]["param_groups"])) for d in (restored, saved)]
    assert groups[0] == groups[1]  # rank 1's betas come as a list, rank 0's as a tuple: the same to AdamW
    torch.testing.assert_close(trainer.ema.model.state_dict(), ema.model.state_dict(), rtol=0, atol=0)
    assert (trainer.step, trainer.ema.updates, trainer.position.epoch, trainer.position.offset) == (3, 1, 1, 2)
    assert torch.equal(torch.get_rng_state(), rng[rank])
    dist.destroy_process_group()


def test_a_resume_on_two_ranks_reads_the_state_on_rank_0_and_gives_every_rank_its_tensors(tmp_path):
    # Every rank used to load the whole model and optimiser state from the file into host memory.
    import torch.multiprocessing as mp

    mp.spawn(_restore_on_rank, args=(str(tmp_path),), nprocs=2)
