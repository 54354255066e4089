"""The training input pipeline: value range, crops, splits."""
import numpy as np
import pytest

from pipelines.schema import ShardSet
from training.data import (
    DecodeBatch, ShardImageDataset, eval_transform, inception_crop, split_rows, train_transform,
)


def _photo():
    from common.photos import photo

    return np.asarray(photo("chelsea.png"))


def test_train_and_eval_outputs_are_chw_in_minus_one_one():
    arr = _photo()
    rng = np.random.default_rng(0)
    for t in (train_transform(32), train_transform(32, flip=False, min_area=1.0), eval_transform(48)):
        x = t(arr, rng)
        assert x.dtype == np.float32 and x.shape[0] == 3 and x.shape[1] == x.shape[2]
        assert -1.0 <= x.min() < x.max() <= 1.0


def test_same_seed_same_augmentation():
    arr = _photo()
    t = train_transform(32)
    a = t(arr, np.random.default_rng((0, 1, 7)))
    b = t(arr, np.random.default_rng((0, 1, 7)))
    c = t(arr, np.random.default_rng((0, 2, 7)))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_inception_crop_respects_min_area():
    from PIL import Image

    img = Image.fromarray(_photo())
    out = inception_crop(img, 24, np.random.default_rng(0), area=(0.9, 1.0))
    assert out.size == (24, 24)
    with pytest.raises(ValueError, match="min_area"):
        train_transform(32, min_area=0.0)


def test_split_rows_is_seeded_disjoint_and_complete():
    train, held = split_rows(100, 0.1, seed=3)
    assert len(held) == 10 and len(train) == 90
    assert sorted(np.concatenate([train, held]).tolist()) == list(range(100))
    assert np.array_equal(split_rows(100, 0.1, seed=3)[1], held)
    assert not np.array_equal(split_rows(100, 0.1, seed=4)[1], held)


@pytest.fixture(scope="module")
def multi_label_shards(tmp_path_factory, mlflow_store):
    """A real shard set from a JFT-style manifest: two rows with two labels, two with one."""
    import json

    from common.photos import photo
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    root = tmp_path_factory.mktemp("multi")
    rows = []
    for i, (name, labels) in enumerate([("chelsea.png", ["cat", "indoor"]), ("coffee.png", ["cup"]),
                                        ("astronaut.png", ["person", "indoor"]), ("rocket.jpg", ["rocket"])]):
        photo(name, max_side=64).save(root / f"{i}.png")
        rows.append({"uri": str(root / f"{i}.png"), "labels": labels})
    (root / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_prepare(PrepareConfig(input=[str(root / "labels.jsonl")], output=str(root / "shards"), size=32, workers=1))
    return ShardSet(str(root / "shards"))


def test_both_loaders_refuse_a_multi_label_row_in_single_label_mode(multi_label_shards):
    from common.config import ConfigError

    ss = multi_label_shards
    multi = [i for i in range(len(ss)) if len(ss[i]["labels"]) == 2]
    assert len(multi) == 2
    with pytest.raises(ConfigError, match="has 2 labels but label_mode='single'"):
        ShardImageDataset(ss, eval_transform(16), label_mode="single")[multi[0]]
    batch = next(ss.iter_batches()).to_pydict()
    with pytest.raises(ConfigError, match="has 2 labels but label_mode='single'"):
        DecodeBatch(16, label_mode="single", num_classes=len(ss.label_map), holdout=0.0)(batch)


def test_both_loaders_encode_multi_hot_targets_alike(multi_label_shards):
    ss = multi_label_shards
    ds = ShardImageDataset(ss, eval_transform(16), label_mode="multi")
    mapped = np.stack([ds[i][1].numpy() for i in range(len(ss))])
    batch = next(ss.iter_batches()).to_pydict()
    assert len(batch["key"]) == len(ss) == 4
    streamed = DecodeBatch(16, label_mode="multi", num_classes=len(ss.label_map), holdout=0.0)(batch)["label"]
    np.testing.assert_array_equal(mapped, streamed)
    names = ss.label_names
    assert sorted(names[j] for j in np.nonzero(mapped[multi_row(ss)])[0]) == ["cat", "indoor"]


def multi_row(ss):
    return next(i for i in range(len(ss)) if ss[i]["source"].endswith("0.png"))
