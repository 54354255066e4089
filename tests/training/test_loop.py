"""training.loop: schedules, and the loss, accumulation and evaluation steps that every training job shares."""
import numpy as np
import pytest
import torch

import vitcore
from training.loop import accumulate_step, classification_loss, effective_warmup, evaluate, lr_at


def test_schedule_warms_up_then_decays():
    lrs = [lr_at(s, total=100, warmup=10, peak=1.0, schedule="linear") for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] < 0.02
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    cos = [lr_at(s, total=100, warmup=0, peak=1.0, schedule="cosine") for s in (0, 50, 99)]
    assert cos[0] == pytest.approx(1.0) and cos[1] == pytest.approx(0.5, abs=0.02) and cos[2] < 0.01
    assert effective_warmup(10_000, 200) == 20


def _tiny_model():
    torch.manual_seed(0)
    model = vitcore.create_model("Ti/8", num_classes=5, img_size=16, depth=2, dropout=0.0)
    for p in model.head.parameters():  # a zero head has zero gradients below it; make the test see them
        torch.nn.init.normal_(p, std=0.1)
    return model.double()


def test_accumulated_step_equals_the_large_batch_step():
    """Pre-training's and fine-tuning's batch on any device: 4 microbatches make the step of their union."""
    x = torch.randn(8, 3, 16, 16, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    big, acc = _tiny_model(), _tiny_model()
    for model, parts in ((big, 1), (acc, 4)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        chunks = list(zip(x.chunk(parts), y.chunk(parts)))
        for _ in range(2):  # a second step also checks that gradients do not leak across steps
            loss, norm = accumulate_step(model, opt, iter(chunks),
                                         lambda b, m=model: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                                         count=parts, grad_clip=1.0)
        assert loss > 0 and norm > 0
    for (name, p), q in zip(big.named_parameters(), acc.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-10, msg=name)


def stripes(n: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy horizontal (class 0) or vertical (class 1) stripes of random period and phase, in [-1, 1]."""
    labels = rng.integers(0, 2, n)
    grid = np.arange(16, dtype=np.float32)
    images = []
    for label in labels:
        wave = np.sin(2 * np.pi * (grid / rng.uniform(3, 6) + rng.uniform()))
        img = np.broadcast_to(wave[:, None] if label == 0 else wave[None, :], (16, 16)) + rng.normal(0, 0.3, (16, 16))
        images.append(np.repeat(img[None], 3, axis=0))
    return torch.tensor(np.stack(images), dtype=torch.float32).clamp(-1, 1), torch.tensor(labels)


@pytest.mark.parametrize("multi_hot", [False, True])
def test_a_tiny_vit_learns_a_separable_task_well_above_chance(multi_hot):
    # A loss of the wrong sign, a head that is not trained or targets that do not reach the
    # loss all stay near chance (0.5) on held-out images; the real steps reach 0.9 in 60 steps.
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a shared 2-core runner
    try:
        _train_and_check(multi_hot)
    finally:
        torch.set_num_threads(threads)


def _train_and_check(multi_hot: bool) -> None:
    rng = np.random.default_rng(0)
    x_train, y_train = stripes(256, rng)
    x_test, y_test = stripes(128, rng)
    if multi_hot:  # the sigmoid path (multi-label corpora), one label per image here
        y_train, y_test = (torch.nn.functional.one_hot(y, 2).float() for y in (y_train, y_test))
    model = vitcore.create_model("mu/4", num_classes=2, img_size=16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    steps, batch = 60, 32
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total=steps, warmup=5, peak=3e-3, schedule="cosine")
        i = torch.from_numpy(rng.integers(0, len(x_train), batch))
        accumulate_step(model, opt, [(x_train[i], y_train[i])],
                        lambda b: classification_loss(model(b[0]), b[1])[0] / batch, count=1, grad_clip=1.0)
    scores = evaluate(model, [(x_test[:64], y_test[:64]), (x_test[64:], y_test[64:])], torch.device("cpu"), False)
    assert scores["n"] == 128
    assert scores["accuracy"] >= 0.9, scores
