"""training.sgd: the fine-tuning loop's Polyak averaging."""
import pytest
import torch

from training.sgd import Polyak


def test_polyak_average_is_what_the_run_evaluates():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    avg = Polyak(model, 0.5)
    values = [1.0, 2.0, 3.0]
    expected = 0.0
    for n, v in enumerate(values):
        with torch.no_grad():
            model.weight.fill_(v)
        avg.update(model)
        d = min(0.5, (1 + n) / (10 + n))
        expected = d * expected + (1 - d) * v
    assert avg.model.weight.flatten().tolist() == pytest.approx([expected, expected])
    assert model.weight[0, 0].item() == 3.0  # the trained model itself is left alone
