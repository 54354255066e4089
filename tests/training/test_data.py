"""The training input pipeline: value range, crops, splits."""
import numpy as np
import pytest

from training.data import eval_transform, inception_crop, split_rows, train_transform


def _photo():
    from demo.data import photo

    return np.asarray(photo("skimage", "chelsea.png"))


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
