import math

import numpy as np
import pytest
import torch

import vitcore


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = vitcore.create_model("mu/8", img_size=32, num_classes=4, depth=3, num_heads=2)
    with torch.no_grad():
        for blk in m.blocks:  # sharper attention than the near-uniform init
            blk.attn.qkv.weight.mul_(4)
    return m


def images(n=3):
    return torch.rand(n, 3, 32, 32) * 2 - 1


def test_embedding_filter_pcs(model, tmp_path):
    comps, ratio = vitcore.embedding_filter_pcs(model, num_components=28, path=tmp_path / "pcs.png")
    assert comps.shape == (28, 3, 8, 8) and ratio.shape == (28,)
    np.testing.assert_allclose(np.linalg.norm(comps.reshape(28, -1), axis=1), 1, atol=1e-5)
    assert np.all(np.diff(ratio) <= 1e-12) and 0 < ratio.sum() <= 1 + 1e-9
    assert (tmp_path / "pcs.png").read_bytes()[:4] == b"\x89PNG"


def test_filter_pcs_refuse_hybrids():
    with torch.device("meta"):
        hybrid = vitcore.create_model("R50+B/16", depth=1)
    with pytest.raises(ValueError, match="hybrid"):
        vitcore.embedding_filter_pcs(hybrid)


def test_position_similarity_grid(model, tmp_path):
    sim = vitcore.position_embedding_similarity(model, path=tmp_path / "pos.png")
    assert sim.shape == (4, 4, 4, 4) and sim.min() >= -1 and sim.max() <= 1
    np.testing.assert_allclose([sim[r, c, r, c] for r in range(4) for c in range(4)], 1, atol=1e-6)
    np.testing.assert_allclose(sim, sim.transpose(2, 3, 0, 1), atol=1e-6)
    assert (tmp_path / "pos.png").exists()


def test_sincos_position_similarity_decays_with_distance():
    m = vitcore.create_model("mu/4", img_size=32, posemb="sincos2d")
    sim = vitcore.position_embedding_similarity(m)
    assert sim[3, 3, 3, 4] > sim[3, 3, 3, 7] and sim[3, 3, 4, 3] > sim[3, 3, 7, 3]


def test_mean_attention_distance(model, tmp_path):
    dist = vitcore.mean_attention_distance(model, images(), path=tmp_path / "dist.png")
    assert dist.shape == (3, 2)
    assert (dist >= 0).all() and (dist <= 8 * math.hypot(3, 3)).all()
    assert (tmp_path / "dist.png").exists()


def test_attention_distance_of_a_uniform_head_is_the_mean_pairwise_distance():
    m = vitcore.create_model("mu/8", img_size=32, depth=1)
    with torch.no_grad():
        m.blocks[0].attn.qkv.weight[:64].zero_()  # q = k = 0: uniform attention
        m.blocks[0].attn.qkv.bias[:64].zero_()
    c = np.stack(np.meshgrid(np.arange(4), np.arange(4), indexing="ij"), -1).reshape(-1, 2) * 8
    expected = np.linalg.norm(c[:, None] - c[None], axis=-1).mean()
    np.testing.assert_allclose(vitcore.mean_attention_distance(m, images(1)), expected, rtol=1e-5)


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_attention_rollout(classifier, tmp_path):
    torch.manual_seed(0)
    m = vitcore.create_model("mu/8", img_size=32, depth=2, classifier=classifier)
    maps = vitcore.attention_rollout(m, images(2), path=tmp_path / "roll.png")
    assert maps.shape == (2, 4, 4) and maps.min() >= 0 and np.allclose(maps.max(axis=(1, 2)), 1)
    assert (tmp_path / "roll.png").exists()


def test_rollout_is_the_product_of_head_averaged_residual_attention():
    torch.manual_seed(1)
    m = vitcore.create_model("mu/8", img_size=32, depth=2)
    x = images(1)
    attn = vitcore.attention_weights(m, x)
    a = [w[0].mean(0) + torch.eye(17) for w in attn]
    a = [w / w.sum(-1, keepdim=True) for w in a]
    row = (a[1] @ a[0])[0, 1:]
    np.testing.assert_allclose(vitcore.attention_rollout(m, x)[0].ravel(), (row / row.max()).numpy(), rtol=1e-5)
