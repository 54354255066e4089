"""Ray Tune fine-tuning: input checks that name the problem, and the selected model."""

import pytest

import vitcore
from vitscale.config import ConfigError
from vitscale.finetune import FinetuneConfig, run_finetune


def test_missing_pretrained_model_is_named(small_demo, tmp_path):
    shards = small_demo["work"] / "shards"
    cfg = FinetuneConfig(train=str(shards / "digits-train"), test=str(shards / "digits-test"),
                         pretrained=str(tmp_path / "missing.safetensors"), output=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="pretrained: .*missing.safetensors does not exist"):
        run_finetune(cfg)


def test_mismatched_label_maps_are_refused(small_demo, tmp_path):
    shards = small_demo["work"] / "shards"
    cfg = FinetuneConfig(train=str(shards / "digits-train"), test=str(shards / "corpus"), output=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="test: label map of .* differs from train's"):
        run_finetune(cfg)


def test_missing_train_shards_are_named(tmp_path):
    cfg = FinetuneConfig(train=str(tmp_path / "t"), test=str(tmp_path / "u"), output=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="train: .* has no manifest.json"):
        run_finetune(cfg)


def test_selected_model_is_the_best_on_val_and_has_a_fresh_head(small_demo):
    fine = small_demo["summary"]["finetune"]
    best = max(fine["trials"], key=lambda r: r["val_accuracy"])
    assert fine["selected_val_accuracy"] == best["val_accuracy"]
    model = vitcore.load_checkpoint(fine["model"])
    assert model.config.num_classes == 10 and model.config.representation_size is None
