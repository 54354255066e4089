"""Ray Tune fine-tuning: input checks that name the problem, and the selected model."""

import pytest

import vitcore
from common.config import ConfigError
from training.finetune import FinetuneConfig, run_finetune


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


def test_a_split_whose_every_image_was_quarantined_is_refused_before_ray(tmp_path, mlflow_store):
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.jpg").write_bytes(b"")  # quarantined: the shard set has no rows
    run_prepare(PrepareConfig(input=[str(tmp_path / "src")], output=str(tmp_path / "empty"), workers=1))
    cfg = FinetuneConfig(train=str(tmp_path / "empty"), test=str(tmp_path / "empty"), output=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="train: .*empty has 0 rows, too few to hold out"):
        run_finetune(cfg)
    assert not (tmp_path / "o").exists()


def test_selected_model_is_the_best_on_val_and_has_a_fresh_head(small_demo):
    fine = small_demo["summary"]["finetune"]
    best = max(fine["trials"], key=lambda r: r["val_accuracy"])
    assert fine["selected_val_accuracy"] == best["val_accuracy"]
    model = vitcore.load_checkpoint(fine["model"])
    assert model.config.num_classes == 10 and model.config.representation_size is None
