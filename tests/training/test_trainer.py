"""The pre-training worker (training.trainer) on real Ray: its loader processes and its step options."""
import math

import numpy as np
import pytest
import torch

import vitcore
from training.pretrain import PretrainConfig, run_pretrain

TINY = dict(variant="Ti/8", depth=1, img_size=32, num_workers=1, warmup_steps=2, holdout=0.1, log_every=2,
            steps=4, batch_size=8, microbatch=4, dropout=0.1)


@pytest.fixture(scope="module")
def photo_shards(tmp_path_factory, mlflow_store, ray_session):
    """Crops of real photos in three classes, stored as JPEG shards with a 64 px shorter side."""
    from common.photos import photo
    from demo.data import random_crop
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    root = tmp_path_factory.mktemp("trainer")
    rng = np.random.default_rng(0)
    for name in ("chelsea.png", "coffee.png", "astronaut.png"):
        folder = root / "src" / name.split(".")[0]
        folder.mkdir(parents=True)
        base = photo(name, max_side=200)
        for i in range(14):
            random_crop(base, 96, rng).save(folder / f"{i}.jpg", quality=90)
    run_prepare(PrepareConfig(input=[str(root / "src")], output=str(root / "shards"), size=64, workers=1))
    return str(root / "shards")


def test_loader_processes_reusing_their_canvases_train_the_in_process_parameters(photo_shards, tmp_path):
    """The device-augment path through two DataLoader processes, whose canvases the trainer hands
    back batch after batch (training.data.release_canvases), ends at the parameters of a run that
    decodes in process: no canvas is overwritten while the step still reads it."""
    runs = [run_pretrain(PretrainConfig(data=photo_shards, output=str(tmp_path / f"w{w}"), run_name=f"w{w}",
                                        augment="device", loader_workers=w, **TINY)) for w in (0, 2)]
    assert [r["steps"] for r in runs] == [4, 4]
    a, b = (vitcore.load_checkpoint(r["model"]) for r in runs)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


def test_a_compiled_step_with_fused_adamw_trains_through_the_trainer(photo_shards, tmp_path):
    """--compile default --fused-adamw on CPU (the smallest model: one compile) trains and saves a
    loadable model; the checkpoint's names are the model's, not torch.compile's wrapper's."""
    out = run_pretrain(PretrainConfig(data=photo_shards, output=str(tmp_path / "c"), run_name="c",
                                      compile="default", fused_adamw=True, **TINY))
    assert out["steps"] == 4 and math.isfinite(out["metrics"]["train_loss"])
    assert "pos_embed" in vitcore.load_checkpoint(out["model"]).state_dict()
