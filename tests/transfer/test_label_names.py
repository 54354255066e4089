"""The class names travel with the model: in each stage's summary and in the model file's metadata."""
from __future__ import annotations

import json

from safetensors import safe_open

from transfer.finetune import FinetuneConfig, run_finetune


def _labels(path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["labels"])


def test_pretrain_and_finetune_models_name_their_classes(tiny_shards, tmp_path, mlflow_store, build_pretrained,
                                                          ray_session):
    from training.pretrain import PretrainConfig, run_pretrain

    pre = run_pretrain(PretrainConfig(data=str(tiny_shards), output=str(tmp_path / "pre"), variant="Ti/8", depth=1,
                                      img_size=32, epochs=1, batch_size=8, num_workers=1, warmup_steps=1,
                                      run_name="labels"))
    assert pre["label_map"] == {"cat": 0, "coffee": 1} and _labels(pre["model"]) == ["cat", "coffee"]

    fine = run_finetune(FinetuneConfig(train=str(tiny_shards), test=str(tiny_shards), output=str(tmp_path / "fine"),
                                       pretrained=pre["model"], lrs=[0.1], steps=2, batch_size=4, warmup_steps=1,
                                       val_fraction=0.25))
    assert fine["label_map"] == {"cat": 0, "coffee": 1} and _labels(fine["model"]) == ["cat", "coffee"]
    assert json.loads((tmp_path / "fine" / "finetune_summary.json").read_text())["label_map"] == fine["label_map"]
