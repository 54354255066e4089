"""training.ema: the weight average pre-training and fine-tuning share, and its state."""
import torch

from training.ema import Polyak


def _step(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))


def test_an_average_restored_from_its_state_continues_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    whole, cut = Polyak(model, 0.99), Polyak(model, 0.99)
    for s in range(3):
        _step(model, s)
        whole.update(model), cut.update(model)
    state = cut.state_dict()
    resumed = Polyak(model, 0.99)  # a new run builds it from the restored model, then loads the state
    resumed.load_state_dict(state)
    for s in range(3, 6):
        _step(model, s)
        whole.update(model), resumed.update(model)
    assert resumed.updates == whole.updates == 6
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(whole.model[0].weight, model[0].weight)  # an average, not the weights
