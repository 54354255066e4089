"""The device half of the train input: PIL's bilinear resize, flip and value range for a batch."""
import numpy as np
import pytest
import torch
from PIL import Image

from training.augment import crop_resize_flip, device_batch


def _canvas(rng, n, h, w):
    return torch.from_numpy(rng.integers(0, 256, size=(n, h, w, 3), dtype=np.uint8))


def test_each_sample_matches_pil_with_its_own_box_and_flip():
    """One call resizes every sample with its own box (up- and downscales, fractional edges) and
    flip, to PIL's ``resize(BILINEAR, box=...)`` within its uint8 rounding."""
    rng = np.random.default_rng(0)
    image = _canvas(rng, 4, 50, 60)
    boxes = [(0, 0, 60, 50), (3.5, 7.25, 40, 30), (10, 0, 22, 48), (20, 10, 59, 49)]
    extent = torch.tensor([[50, 60], [50, 60], [48, 40], [50, 60]])
    flip = torch.tensor([False, True, False, True])
    out = crop_resize_flip(image, torch.tensor(boxes), extent, flip, 24) * 127.5 + 127.5
    for k, box in enumerate(boxes):
        h, w = extent[k].tolist()
        ref = Image.fromarray(image[k, :h, :w].numpy()).resize((24, 24), Image.BILINEAR, box=box)
        if flip[k]:
            ref = ref.transpose(Image.FLIP_LEFT_RIGHT)
        assert np.abs(out[k].numpy() - np.asarray(ref, np.float32).transpose(2, 0, 1)).max() <= 1.01


def test_pixels_beyond_the_extent_are_never_read():
    rng = np.random.default_rng(1)
    image = _canvas(rng, 1, 30, 30)
    args = (torch.tensor([[0.0, 0.0, 20.0, 20.0]]), torch.tensor([[20, 20]]), torch.tensor([False]), 8)
    a = crop_resize_flip(image, *args)
    image[:, 20:], image[:, :, 20:] = 0, 255
    assert torch.equal(a, crop_resize_flip(image, *args))


def test_output_is_float_chw_in_minus_one_one():
    image = torch.tensor([0, 255], dtype=torch.uint8).repeat_interleave(32 * 32 * 3 // 2).view(1, 32, 32, 3)
    x = crop_resize_flip(image, torch.tensor([[0.0, 0.0, 32.0, 32.0]]), torch.tensor([[32, 32]]),
                         torch.tensor([False]), 16)
    assert x.dtype == torch.float32 and x.shape == (1, 3, 16, 16)
    assert x.min() == -1.0 and x.max() == 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_device_batch_runs_where_the_batch_is_sent():
    rng = np.random.default_rng(2)
    batch = {"image": _canvas(rng, 2, 20, 20), "box": torch.tensor([[0.0, 0.0, 20.0, 20.0]] * 2),
             "extent": torch.tensor([[20, 20]] * 2), "flip": torch.tensor([True, False]), "label": torch.tensor([1, 0])}
    x, y = device_batch(batch, 16, "cuda")
    ref, _ = device_batch(batch, 16, "cpu")
    assert x.is_cuda and y.is_cuda and torch.allclose(x.cpu(), ref, atol=1e-3)
