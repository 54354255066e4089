import math

import numpy as np
import pytest
import scipy.ndimage
import torch

from vitcore.posembed import adapt_pos_embed, resize_grid, sincos_1d, sincos_2d


def official_resize(posemb: np.ndarray, new_hw, prefix: int) -> np.ndarray:
    """vit_jax checkpoint.py: split off the class slot, scipy zoom(order=1), re-attach."""
    tok, grid = posemb[:, :prefix], posemb[0, prefix:]
    side = int(math.isqrt(len(grid)))
    grid = grid.reshape(side, side, -1)
    zoom = (new_hw[0] / side, new_hw[1] / side, 1)
    grid = scipy.ndimage.zoom(grid, zoom, order=1).reshape(1, new_hw[0] * new_hw[1], -1)
    return np.concatenate([tok, grid], axis=1)


@pytest.mark.parametrize("new_hw", [(12, 12), (24, 24), (5, 5), (8, 11)])
def test_resize_matches_official_scipy_zoom(new_hw):
    rng = np.random.default_rng(0)
    posemb = rng.normal(size=(1, 1 + 7 * 7, 6)).astype(np.float64)
    ours = adapt_pos_embed(torch.from_numpy(posemb), new_grid=new_hw, new_prefix=1, old_prefix=1)
    np.testing.assert_allclose(ours.numpy(), official_resize(posemb, new_hw, 1), atol=1e-10)


def test_identity_resize_returns_the_embedding_unchanged():
    posemb = torch.randn(1, 1 + 14 * 14, 8)
    assert torch.equal(adapt_pos_embed(posemb, new_grid=(14, 14), new_prefix=1, old_prefix=1), posemb)
    grid = torch.randn(5, 7, 3)
    assert torch.equal(resize_grid(grid, (5, 7)), grid)


def test_class_slot_is_kept_through_a_resize():
    posemb = torch.randn(1, 1 + 4 * 4, 8)
    out = adapt_pos_embed(posemb, new_grid=(6, 6), new_prefix=1, old_prefix=1)
    assert out.shape == (1, 37, 8) and torch.equal(out[:, 0], posemb[:, 0])
    # corners map onto corners (align_corners=True)
    assert torch.allclose(out[0, 1], posemb[0, 1]) and torch.allclose(out[0, -1], posemb[0, -1])


def test_non_square_source_grid():
    posemb = torch.randn(1, 3 * 5, 4)
    out = adapt_pos_embed(posemb, new_grid=(6, 10), new_prefix=0, old_prefix=0, old_grid=(3, 5))
    expected = scipy.ndimage.zoom(posemb[0].reshape(3, 5, 4).numpy(), (2, 2, 1), order=1)
    np.testing.assert_allclose(out[0].reshape(6, 10, 4).numpy(), expected, atol=1e-5)


def test_missing_class_slot_becomes_zero_and_extra_slot_is_dropped():
    grid = torch.randn(1, 9, 4)
    with_slot = adapt_pos_embed(grid, new_grid=(3, 3), new_prefix=1, old_prefix=0)
    assert torch.equal(with_slot[:, 0], torch.zeros(1, 4)) and torch.equal(with_slot[:, 1:], grid)
    dropped = adapt_pos_embed(with_slot, new_grid=(3, 3), new_prefix=0, old_prefix=1)
    assert torch.equal(dropped, grid)


def test_non_square_grid_without_shape_is_refused():
    with pytest.raises(ValueError, match="not a square grid; pass old_grid"):
        adapt_pos_embed(torch.randn(1, 1 + 12, 4), new_grid=(4, 4), new_prefix=1, old_prefix=1)


def test_sincos_is_the_transformer_encoding_on_both_axes():
    pe = sincos_1d(torch.arange(10), 8)
    pos, i = 7, 3
    assert pe[pos, 2 * i] == pytest.approx(math.sin(pos / 10000 ** (2 * i / 8)), abs=1e-6)
    assert pe[pos, 2 * i + 1] == pytest.approx(math.cos(pos / 10000 ** (2 * i / 8)), abs=1e-6)
    grid = sincos_2d((3, 4), 16).reshape(3, 4, 16)
    row, col = sincos_1d(torch.arange(3), 8), sincos_1d(torch.arange(4), 8)
    assert torch.allclose(grid[2, 1, :8], row[2]) and torch.allclose(grid[2, 1, 8:], col[1])
