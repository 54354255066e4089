import numpy as np
import pytest
import torch

import vitcore
from vitcore.fewshot import BIAS_CONSTANT, fewshot_accuracy, fit_ridge, select_shots


def direct_solution(x, y, k, l2):
    mean, std = x.mean(0), x.std(0) + 1e-5
    xd = np.pad((x - mean) / std, ((0, 0), (0, 1)), constant_values=BIAS_CONSTANT)
    t = 2 * np.eye(k)[y] - 1
    return np.linalg.solve(xd.T @ xd + l2 * np.eye(xd.shape[1]), xd.T @ t)


@pytest.mark.parametrize("n,d", [(200, 20), (15, 64)])
@pytest.mark.parametrize("form", ["primal", "dual"])
def test_closed_form_matches_direct_solve(n, d, form):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(n, d)), rng.integers(0, 5, n)
    clf = fit_ridge(x, y, 5, l2_reg=2.0 ** 10, form=form)
    np.testing.assert_allclose(clf.weights, direct_solution(x, y, 5, 2.0 ** 10), rtol=1e-6, atol=1e-9)


def test_auto_form_chooses_by_n_and_d(monkeypatch):
    calls = []
    real = np.linalg.eigh
    monkeypatch.setattr(np.linalg, "eigh", lambda a: calls.append(a.shape) or real(a))
    rng = np.random.default_rng(0)
    fit_ridge(rng.normal(size=(10, 50)), np.arange(10) % 2, 2)
    fit_ridge(rng.normal(size=(100, 5)), np.arange(100) % 2, 2)
    assert calls == [(10, 10), (6, 6)]  # dual N x N, then primal (D+1) x (D+1)


def test_select_shots_takes_k_per_class_and_depends_on_seed():
    labels = np.repeat(np.arange(4), 30)
    idx = select_shots(labels, 5, seed=0)
    assert np.bincount(labels[idx]).tolist() == [5] * 4
    assert not np.array_equal(idx, select_shots(labels, 5, seed=1))
    with pytest.raises(ValueError, match="class 0 has 30 training examples, fewer than 40 shots"):
        select_shots(labels, 40, seed=0)


def test_fewshot_accuracy_on_separable_features():
    rng = np.random.default_rng(0)
    centres = rng.normal(scale=3, size=(10, 64))
    ytr, yte = np.repeat(np.arange(10), 30), np.repeat(np.arange(10), 20)
    xtr = centres[ytr] + rng.normal(size=(300, 64))
    xte = centres[yte] + rng.normal(size=(200, 64))
    res = fewshot_accuracy(xtr, ytr, xte, yte, shots=(1, 5, 25), seeds=(0, 1, 2), l2_reg=1.0)
    assert set(res) == {1, 5, 25} and len(res[5]["per_seed"]) == 3
    assert res[25]["mean"] > 0.95 and res[1]["mean"] > 0.3
    shuffled = fewshot_accuracy(xtr, rng.permutation(ytr), xte, yte, shots=(25,), seeds=(0,), l2_reg=1.0)
    assert shuffled[25]["mean"] < 0.3  # chance is 0.1


def test_representations_come_from_pre_logits():
    model = vitcore.create_model("mu/8", img_size=16, num_classes=3, representation_size=24)
    feats = vitcore.compute_representations(model, torch.rand(5, 3, 16, 16), batch_size=2)
    assert feats.shape == (5, 24) and np.abs(feats).max() <= 1
