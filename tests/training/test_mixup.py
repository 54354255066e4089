"""training.mixup: Mixup and CutMix of a batch, with soft targets and resume-exact random choices."""
import numpy as np
import pytest
import torch

from training.losses import classification_loss
from training.mixup import Mixer


def _batch(b=6, classes=4):
    torch.manual_seed(0)
    return torch.randn(b, 3, 16, 20), torch.arange(b) % classes


@pytest.mark.parametrize("mixer", [Mixer(mixup=0.8), Mixer(cutmix=1.0), Mixer(mixup=0.8, cutmix=1.0)])
def test_mixed_targets_sum_to_one_and_go_through_both_losses(mixer):
    x, y = _batch()
    for step in range(10):
        mx, my = mixer(x, y, 4, key=(step, 0, 0))
        assert mx.shape == x.shape and my.shape == (6, 4)
        torch.testing.assert_close(my.sum(1), torch.ones(6))
        for head in ("softmax", "sigmoid"):
            loss, _ = classification_loss(torch.zeros(6, 4), my, head=head)
            assert torch.isfinite(loss)


def test_cutmix_lambda_is_the_area_the_box_leaves():
    x, y = _batch()
    mixer = Mixer(cutmix=1.0, seed=3)
    for step in range(20):
        draw = mixer.draw(16, 20, (step, 0, 0))
        mx, my = mixer(x, y, 4, key=(step, 0, 0))
        from_partner = (mx[0] != x[0]).any(0).float().mean().item()  # pixels of image 0 taken from image 5
        assert draw.cutmix and from_partner == pytest.approx(1 - draw.lam)
        assert my[0, y[0]].item() == pytest.approx(draw.lam) and my[0, y[5]].item() == pytest.approx(1 - draw.lam)


def test_mixup_blends_images_with_the_targets_weight():
    x, y = _batch()
    mixer = Mixer(mixup=0.2)
    draw = mixer.draw(16, 20, (7, 1, 0))
    mx, my = mixer(x, y, 4, key=(7, 1, 0))
    torch.testing.assert_close(mx[1], draw.lam * x[1] + (1 - draw.lam) * x[4])
    assert my[1, y[1]].item() == pytest.approx(draw.lam)


def test_the_switch_picks_cutmix_at_its_rate_and_a_key_always_gives_the_same_batch():
    mixer = Mixer(mixup=0.8, cutmix=1.0, switch_prob=0.3)
    picks = [mixer.draw(16, 16, (s, 0, 0)).cutmix for s in range(2000)]
    assert np.mean(picks) == pytest.approx(0.3, abs=0.04)
    x, y = _batch()
    again = Mixer(mixup=0.8, cutmix=1.0, switch_prob=0.3)  # a resumed run builds its mixer anew
    for key in ((5, 0, 0), (5, 1, 0), (5, 0, 1)):
        a, b = mixer(x, y, 4, key=key), again(x, y, 4, key=key)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(mixer(x, y, 4, key=(5, 0, 0))[0], mixer(x, y, 4, key=(6, 0, 0))[0])
