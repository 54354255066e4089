"""The pre-training step's options: compile modes and the fused AdamW kernel, on CPU."""
import shutil

import pytest
import torch

import vitcore
from training.step import adamw, compile_mode, compile_model


def test_auto_compiles_on_gpu_and_stays_eager_on_cpu():
    assert compile_mode("auto", "cuda") == "default"
    assert compile_mode("auto", "cpu") is None
    assert compile_mode("eager", "cuda") is None
    assert compile_mode("max-autotune", "cpu") == "max-autotune"
    with pytest.raises(ValueError, match="compile option 'fast': use one of auto, eager"):
        compile_mode("fast", "cuda")


def _tiny():
    torch.manual_seed(0)
    return vitcore.create_model("Ti/16", num_classes=3, img_size=32, depth=1, width=32, mlp_dim=64, num_heads=2)


def _train(model, opt, steps=3):
    x, y = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0])
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss


def test_fused_adamw_makes_the_same_update_with_the_same_decay_groups():
    plain, fused = _tiny(), _tiny()
    opt_plain = adamw(plain, lr=1e-2, weight_decay=0.1)
    opt_fused = adamw(fused, lr=1e-2, weight_decay=0.1, fused=True)
    assert opt_fused.defaults["fused"] and not opt_plain.defaults["fused"]
    assert [g["weight_decay"] for g in opt_fused.param_groups] == [0.1, 0.0]
    # One step: from the second on, the key bias (its gradient is float noise) is Adam-normalised noise.
    _train(plain, opt_plain, steps=1), _train(fused, opt_fused, steps=1)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor needs a C++ compiler on CPU")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune"])
def test_each_compile_mode_builds_and_trains_like_eager(mode):
    """Each --compile mode on the smallest model: it compiles on this CPU and steps to the eager
    loss. A CPU does not exercise CUDA graphs or GPU autotuning; benchmarks/gpu_pretrain.py times them."""
    torch._dynamo.reset()
    eager, compiled = _tiny(), _tiny()
    loss_eager = _train(eager, adamw(eager, lr=1e-2, weight_decay=0.1), steps=2)
    loss_compiled = _train(compile_model(compiled, mode), adamw(compiled, lr=1e-2, weight_decay=0.1), steps=2)
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-4, atol=1e-5)
