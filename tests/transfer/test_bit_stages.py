"""A BiT ResNet, the paper's baseline, through the stages a ViT goes through: pre-training,
fine-tuning and few-shot evaluation, on the demo's shards; and the ViT knobs it refuses."""
from __future__ import annotations

import math

import pytest

import vitcore
from common.config import ConfigError
from demo.data import VTAB_TASKS
from training.pretrain import PretrainConfig, run_pretrain
from transfer.fewshot import FewshotConfig, run_fewshot
from transfer.finetune import FinetuneConfig, run_finetune


def test_a_tiny_bit_pretrains_finetunes_and_fewshots(small_demo, tmp_path, capfd):
    work = small_demo["work"]
    pre = run_pretrain(PretrainConfig(data=str(work / "shards" / "corpus"), output=str(tmp_path / "pre"),
                                      variant="BiT-mu", img_size=32, epochs=1, batch_size=32, num_workers=1,
                                      warmup_steps=2, run_name="bit-test"))
    model = vitcore.load_checkpoint(pre["model"])
    assert isinstance(model, vitcore.ResNetV2) and model.config.variant == "BiT-mu"
    assert math.isfinite(pre["metrics"]["train_loss"])
    assert pre["inspection"] == []
    err = capfd.readouterr().err
    assert ("pretrain: no embedding filters, position embedding similarity, mean attention distance figure for "
            "BiT-mu: it has no attention, embedding filters, position embeddings") in err

    fine = run_finetune(FinetuneConfig(train=str(work / "shards" / "digits-train"),
                                       test=str(work / "shards" / "digits-test"), pretrained=pre["model"],
                                       output=str(tmp_path / "fine"), lrs=[0.01], steps=4, batch_size=16,
                                       warmup_steps=1, flip=False))
    tuned = vitcore.load_checkpoint(fine["model"])
    assert isinstance(tuned, vitcore.ResNetV2) and tuned.config.num_classes == 10
    assert 0.0 <= fine["test_accuracy"] <= 1.0

    # The demo's three tasks; a shot count that some class of a task cannot fill is skipped there.
    specs = [f"{group}/{name}={work / 'shards' / 'vtab' / name}" for name, group in VTAB_TASKS.items()]
    few = run_fewshot(FewshotConfig(pretrained=pre["model"], task=specs, output=str(tmp_path / "few"), shots=[1, 2],
                                    draws=1, device="cpu"))
    means = [v for v in few["mean"].values() if v is not None]
    assert set(few["tasks"]) == set(VTAB_TASKS) and means and all(0.0 <= v <= 1.0 for v in means)


@pytest.mark.parametrize("options, message", [
    ({"depth": 2}, "depth: sets a ViT's depth; BiT-mu is a BiT ResNet, whose size is in its name (e.g. BiT-R50x1): "
                   "drop --depth"),
    ({"dropout": 0.2}, "dropout: BiT-mu is a BiT ResNet, which has no dropout; leave out --dropout"),
    ({"objective": "mpp"}, "objective: masked patch prediction needs patches; BiT-mu is a BiT ResNet: use "
                           "--objective classification or a ViT --variant"),
    ({"strategy": "fsdp"}, "strategy: FSDP here shards a ViT's blocks; train BiT-mu with --strategy ddp"),
    ({"variant": "BiT-R51x1"}, "variant: variant 'BiT-R51x1': no BiT ResNet of depth 51"),
])
def test_a_bit_resnet_refuses_a_vits_knobs_before_ray_starts(options, message):
    with pytest.raises(ConfigError) as info:
        PretrainConfig(**{"data": "/d", "variant": "BiT-mu", **options})
    assert str(info.value).startswith(message)


def test_a_bit_resnet_takes_no_dropout_by_default():
    assert PretrainConfig(data="/d", variant="BiT-mu").dropout == 0.0
    assert PretrainConfig(data="/d").dropout == 0.1
