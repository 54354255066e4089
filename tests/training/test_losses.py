"""training.losses: one classification loss for softmax and sigmoid heads, hard or soft targets."""
import math

import pytest
import torch
import torch.nn.functional as F

from training.losses import classification_loss, one_hot


def test_label_smoothed_loss_equals_its_closed_form():
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 3.0]], dtype=torch.float64)
    y = torch.tensor([0, 1])
    eps, classes = 0.1, 3
    expected = 0.0
    for row, label in zip(logits.tolist(), y.tolist()):
        log_z = math.log(sum(math.exp(v) for v in row))
        log_p = [v - log_z for v in row]
        # (1 - ε) on the label and ε/C on every class, including the label.
        expected -= (1 - eps) * log_p[label] + eps / classes * sum(log_p)
    hard, _ = classification_loss(logits, y, head="softmax", label_smoothing=eps)
    soft, _ = classification_loss(logits, one_hot(y, classes), head="softmax", label_smoothing=eps)
    assert float(hard) == pytest.approx(expected, rel=1e-6)
    assert float(soft) == pytest.approx(expected, rel=1e-6)


def test_soft_one_hot_targets_equal_the_integer_path():
    torch.manual_seed(0)
    logits, y = torch.randn(8, 5), torch.randint(0, 5, (8,))
    hard = classification_loss(logits, y, head="softmax")
    soft = classification_loss(logits, one_hot(y, 5), head="softmax")
    torch.testing.assert_close(soft[0], hard[0])
    assert int(soft[1]) == int(hard[1])


def test_without_smoothing_the_hard_path_is_plain_cross_entropy_bit_for_bit():
    torch.manual_seed(1)
    logits, y = torch.randn(16, 7), torch.randint(0, 7, (16,))
    assert torch.equal(classification_loss(logits, y)[0], F.cross_entropy(logits, y, reduction="sum"))
    multi = (torch.rand(16, 7) > 0.6).float()
    assert torch.equal(classification_loss(logits, multi)[0],
                       F.binary_cross_entropy_with_logits(logits, multi, reduction="sum"))


def test_sigmoid_head_takes_soft_targets_and_refuses_smoothing():
    logits = torch.tensor([[0.0, 0.0]])
    loss, _ = classification_loss(logits, torch.tensor([[0.3, 0.7]]), head="sigmoid")
    assert float(loss) == pytest.approx(2 * math.log(2))  # sigmoid(0) = 0.5 whatever the target
    with pytest.raises(ValueError, match="softmax"):
        classification_loss(logits, torch.tensor([[0.0, 1.0]]), head="sigmoid", label_smoothing=0.1)
