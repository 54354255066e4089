"""RandAugment: each op batched on the device matches Pillow on each image, its choices are keyed
by the batch's place, and its config refuses bad values in one line."""
import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from common import tracking
from common.config import free_on_resume, not_recipe, off_values, parse_args
from common.photos import photo
from training.augment import crop_resize_flip, device_batch
from training.checkpointer import check_resumable
from training.data import train_transform
from training.pretrain import PretrainConfig
from training.randaugment import OPS, Choices, RandAugment, apply_batch, apply_pil, batch_op, level, pil_op

GEOMETRIC = ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY")


@pytest.fixture(scope="module")
def images():
    """Three real photographs, 40 px square, and the same as one float batch (B, 3, H, W)."""
    pics = [photo(n, max_side=64).convert("RGB").crop((3, 5, 43, 45)) for n in ("chelsea.png", "coffee.png", "astronaut.png")]
    return pics, torch.from_numpy(np.stack([np.asarray(p) for p in pics])).permute(0, 3, 1, 2).float()


def _pixels(img: Image.Image) -> np.ndarray:
    return np.asarray(img, np.float32).transpose(2, 0, 1)


@pytest.mark.parametrize("magnitude", [5, 9, 15, 23])
@pytest.mark.parametrize("name", OPS)
def test_each_op_on_a_batch_matches_pillow_on_each_image(name, magnitude, images):
    """Photometric ops agree within 1 grey level; geometric ops pick the same source pixel but for
    ties on a sampling boundary (Pillow steps in 16.16 fixed point), a few percent of pixels at most."""
    pics, x = images
    sign, centre = np.array([1, -1, 1]), np.array([[0.1, 0.2], [0.5, 0.5], [0.95, 0.7]])
    out = batch_op(x, name, magnitude, sign, centre)
    for k, pic in enumerate(pics):
        diff = np.abs(out[k].numpy() - _pixels(pil_op(pic, name, magnitude, int(sign[k]), tuple(centre[k]))))
        if name in GEOMETRIC:
            assert (diff > 0).mean() <= 0.03, (name, magnitude, k)
        else:
            assert diff.max() <= 1.0 and (diff > 0).mean() <= 0.01, (name, magnitude, k)


def test_layers_with_a_different_op_per_image_match_pillow(images):
    pics, x = images
    choices = Choices(op=np.array([[9, 3], [14, 1], [6, 11]]), sign=np.array([[1, -1], [-1, 1], [1, 1]]),
                      centre=np.random.default_rng(0).random((3, 2, 2)))
    out = apply_batch(x, choices, 15)
    for k, pic in enumerate(pics):
        diff = np.abs(out[k].numpy() - _pixels(apply_pil(pic, choices.row(k), 15)))
        assert (diff > 1).mean() <= 0.03, k


def test_magnitudes_above_ten_extrapolate_big_visions_table():
    assert level("Rotate", 15) == 45.0 and level("ShearX", 20) == pytest.approx(0.6)
    assert level("TranslateX", 15) == 150.0 and level("Cutout", 15) == 60
    assert level("Color", 15) == pytest.approx(2.8) and level("Solarize", 15) == 384
    assert level("SolarizeAdd", 20) == 220 and level("Posterize", 15) == 6
    # Posterize keeps at most 8 bits; the pixel constants scale with the side (as at 224 px).
    assert level("Posterize", 30) == 8 and level("TranslateX", 10, side=112) == 50.0 and level("Cutout", 10, side=112) == 20


def test_choices_are_keyed_by_the_batchs_place_so_a_resume_redraws_them():
    ra = RandAugment(2, 9, seed=3)
    a, b, c = ra.choices(8, (5, 0, 1)), ra.choices(8, (5, 0, 1)), ra.choices(8, (6, 0, 1))
    assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("op", "sign", "centre"))
    assert not np.array_equal(a.op, c.op)
    assert len(np.unique(ra.choices(64, (0, 0, 0)).op)) > 8  # per-image choices, not one per batch


def test_the_device_path_without_randaug_is_unchanged_and_with_it_stays_in_range():
    rng = np.random.default_rng(4)
    batch = {"image": torch.from_numpy(rng.integers(0, 256, (4, 40, 40, 3), dtype=np.uint8)),
             "box": torch.tensor([[0.0, 0.0, 40.0, 40.0], [3.5, 2.0, 30.0, 33.0]] * 2),
             "extent": torch.tensor([[40, 40]] * 4), "flip": torch.tensor([True, False, False, True]),
             "label": torch.arange(4)}
    plain, _ = device_batch(batch, 16, "cpu")
    assert torch.equal(plain, crop_resize_flip(batch["image"], batch["box"], batch["extent"], batch["flip"], 16))
    x, _ = device_batch(batch, 16, "cpu", RandAugment(2, 15), key=(0, 0, 0))
    assert x.shape == plain.shape and x.min() >= -1.0 and x.max() <= 1.0 and not torch.equal(x, plain)
    again, _ = device_batch(batch, 16, "cpu", RandAugment(2, 15), key=(0, 0, 0))
    assert torch.equal(x, again)


def test_the_item_path_draws_randaug_after_the_crop_and_flip(images):
    arr = np.asarray(images[0][2])
    plain = train_transform(24)(arr, np.random.default_rng(7))
    other = train_transform(24, randaug=RandAugment(2, 9))(arr, np.random.default_rng(7))
    assert plain.shape == other.shape == (3, 24, 24) and not np.array_equal(plain, other)


def test_off_keeps_the_config_hash_and_old_checkpoints_resume():
    cfg = PretrainConfig(data="d")
    record = dataclasses.asdict(cfg)
    before = {k: v for k, v in record.items() if k != "randaug"}  # a config recorded before the field
    hashed_before = {k: v for k, v in before.items() if k not in not_recipe(cfg) and k not in off_values(cfg)}
    assert tracking.config_hash(cfg) == tracking.config_hash(hashed_before)
    check_resumable(before, record, free_on_resume(cfg), off_values(cfg))
    on = parse_args(PretrainConfig, ["--data", "d", "--randaug", "2,9"], prog="pretrain")
    assert on.randaug == [2, 9] and tracking.config_hash(on) != tracking.config_hash(cfg)


@pytest.mark.parametrize("value", ["2,31", "-1,9", "0,9", "2", "2,9,1"])
def test_bad_randaug_values_are_refused_in_one_line_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(PretrainConfig, ["--data", "d", f"--randaug={value}"], prog="pretrain")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "randaug:" in err and "--randaug" in err and len(err.strip().splitlines()) == 1
