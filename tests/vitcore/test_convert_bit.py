"""The official BiT `.npz` layout and timm's state dicts load into vitcore's ResNetV2: checked
on a synthetic checkpoint built from the official key list against an independent NumPy
re-implementation of the BiT forward pass (big_transfer / big_vision bit_paper.py)."""

import warnings

import numpy as np
import pytest
import torch

import vitcore

LAYERS, WIDTH, CLASSES = (2, 1), 32, 5


def bit_npz(layers=LAYERS, width=WIDTH, classes=CLASSES, seed=0, in_chans=3) -> dict[str, np.ndarray]:
    """Every key of the official layout (prefix `resnet/`, HWIO kernels), random values."""
    rng = np.random.default_rng(seed)
    p = {"resnet/root_block/standardized_conv2d/kernel": rng.normal(size=(7, 7, in_chans, width))}
    in_ch = width
    for s, units in enumerate(layers, 1):
        mid = width * 2 ** (s - 1)
        out = 4 * mid
        for u in range(1, units + 1):
            unit = f"resnet/block{s}/unit{u:02d}/"
            if u == 1:
                p[unit + "a/proj/standardized_conv2d/kernel"] = rng.normal(size=(1, 1, in_ch, out))
            shapes = {"a": ((1, 1, in_ch, mid), in_ch), "b": ((3, 3, mid, mid), mid), "c": ((1, 1, mid, out), mid)}
            for part, (kernel, norm_ch) in shapes.items():
                p[f"{unit}{part}/standardized_conv2d/kernel"] = rng.normal(size=kernel)
                p[f"{unit}{part}/group_norm/gamma"] = rng.uniform(0.5, 1.5, size=norm_ch)
                p[f"{unit}{part}/group_norm/beta"] = rng.normal(scale=0.1, size=norm_ch)
            in_ch = out
    p["resnet/group_norm/gamma"] = rng.uniform(0.5, 1.5, size=in_ch)
    p["resnet/group_norm/beta"] = rng.normal(scale=0.1, size=in_ch)
    p["resnet/head/conv2d/kernel"] = rng.normal(scale=0.1, size=(1, 1, in_ch, classes))
    p["resnet/head/conv2d/bias"] = rng.normal(size=classes)
    return {k: v.astype(np.float32) for k, v in p.items()}


# ---------------------------------------------------------------- NumPy reference of the BiT math

def np_std_conv(x, kernel, stride):
    """NHWC input, HWIO kernel standardised as BiT does, symmetric padding k // 2."""
    mean, var = kernel.mean(axis=(0, 1, 2)), kernel.var(axis=(0, 1, 2))
    kernel = (kernel - mean) / np.sqrt(var + 1e-10)
    kh, kw = kernel.shape[:2]
    x = np.pad(x, ((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)))
    n, h, w, _ = x.shape
    oh, ow = (h - kh) // stride + 1, (w - kw) // stride + 1
    out = np.zeros((n, oh, ow, kernel.shape[-1]))
    for i in range(kh):
        for j in range(kw):
            out += x[:, i:i + stride * oh:stride, j:j + stride * ow:stride, :] @ kernel[i, j]
    return out


def np_gn_relu(x, gamma, beta, groups=32, eps=1e-5):
    n, h, w, c = x.shape
    g = x.reshape(n, h, w, groups, c // groups)
    g = (g - g.mean(axis=(1, 2, 4), keepdims=True)) / np.sqrt(g.var(axis=(1, 2, 4), keepdims=True) + eps)
    return np.maximum(g.reshape(n, h, w, c) * gamma + beta, 0)


def np_max_pool_zero_padded(x):
    x = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))  # BiT pads with zeros, then pools 'VALID'
    n, h, w, c = x.shape
    oh, ow = (h - 3) // 2 + 1, (w - 3) // 2 + 1
    return np.max([x[:, i:i + 2 * oh:2, j:j + 2 * ow:2] for i in range(3) for j in range(3)], axis=0)


def np_bit_forward(p, images_nchw):
    x = np_std_conv(images_nchw.transpose(0, 2, 3, 1).astype(np.float64),
                    p["resnet/root_block/standardized_conv2d/kernel"], 2)
    x = np_max_pool_zero_padded(x)
    s = 1
    while f"resnet/block{s}/unit01/a/standardized_conv2d/kernel" in p:
        u = 1
        while (unit := f"resnet/block{s}/unit{u:02d}/") + "a/standardized_conv2d/kernel" in p:
            stride = 2 if (s > 1 and u == 1) else 1
            pre = np_gn_relu(x, p[unit + "a/group_norm/gamma"], p[unit + "a/group_norm/beta"])
            proj = p.get(unit + "a/proj/standardized_conv2d/kernel")
            shortcut = x if proj is None else np_std_conv(pre, proj, stride)
            y = np_std_conv(pre, p[unit + "a/standardized_conv2d/kernel"], 1)
            y = np_gn_relu(y, p[unit + "b/group_norm/gamma"], p[unit + "b/group_norm/beta"])
            y = np_std_conv(y, p[unit + "b/standardized_conv2d/kernel"], stride)
            y = np_gn_relu(y, p[unit + "c/group_norm/gamma"], p[unit + "c/group_norm/beta"])
            x = np_std_conv(y, p[unit + "c/standardized_conv2d/kernel"], 1) + shortcut
            u += 1
        s += 1
    x = np_gn_relu(x, p["resnet/group_norm/gamma"], p["resnet/group_norm/beta"])
    pooled = x.mean(axis=(1, 2))
    return pooled @ p["resnet/head/conv2d/kernel"][0, 0] + p["resnet/head/conv2d/bias"], pooled


def model(**kw):
    return vitcore.create_model("BiT-mu", layers=LAYERS, num_classes=CLASSES, img_size=32, **kw).eval()


def test_every_tensor_of_the_official_layout_lands():
    m = model()
    report = vitcore.load_npz(m, bit_npz())
    assert report.unused == [] and report.skipped == {}
    assert sorted(report.loaded) == sorted(m.state_dict())


def test_loaded_model_reproduces_the_reference_forward():
    """A transposed kernel (the square 3x3 mid->mid ones included) or a swapped norm changes the output."""
    params = bit_npz()
    m = model()
    vitcore.load_npz(m, params)
    x = np.random.default_rng(1).uniform(-1, 1, size=(2, 3, 32, 48)).astype(np.float32)
    want_logits, want_pre = np_bit_forward(params, x)
    with torch.no_grad():
        logits, out = m(torch.from_numpy(x), return_intermediates=True)
    np.testing.assert_allclose(out["pre_logits"].numpy(), want_pre, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits.numpy(), want_logits, rtol=1e-4, atol=1e-4)


def test_kernels_land_in_torch_orientation():
    params = bit_npz()
    m = model()
    vitcore.load_npz(m, params)
    b = params["resnet/block1/unit02/b/standardized_conv2d/kernel"]  # (3, 3, in, out), square in channels
    w = m.stages[0].blocks[1].conv2.weight
    assert torch.equal(w[5, 7, 0, 2], torch.tensor(b[0, 2, 7, 5]))  # [out, in, h, w] <- [h, w, in, out]
    head = params["resnet/head/conv2d/kernel"]
    assert torch.equal(m.head.fc.weight[:, :, 0, 0], torch.from_numpy(head[0, 0].T.copy()))


def test_npz_file_with_broadcast_norms_and_a_new_head(tmp_path):
    params = bit_npz()
    # big_vision stores GroupNorm scales as (1, 1, 1, C); a checkpoint's head may have other classes.
    params = {k: (v.reshape(1, 1, 1, -1) if "group_norm" in k else v) for k, v in params.items()}
    np.savez(tmp_path / "BiT-M-R50x1.npz", **params)
    m = vitcore.create_model("BiT-mu", layers=LAYERS, num_classes=10, img_size=32)
    with pytest.warns(UserWarning, match="head shape does not match"):
        report = vitcore.load_npz(m, tmp_path / "BiT-M-R50x1.npz")
    assert set(report.skipped) == {"head.fc.weight", "head.fc.bias"}
    assert torch.count_nonzero(m.head.fc.weight) == 0
    torch.testing.assert_close(m.norm.weight, torch.from_numpy(params["resnet/group_norm/gamma"].reshape(-1)))


def test_wrong_checkpoint_kinds_are_named():
    with pytest.raises(ValueError, match="not a BiT checkpoint.*'B/16'"):
        vitcore.load_npz(model(), {"embedding/kernel": np.zeros((16, 16, 3, 32), np.float32)})
    with pytest.raises(ValueError, match="a BiT ResNet checkpoint; load it into a BiT variant"):
        vitcore.load_npz(vitcore.create_model("mu/8", img_size=32), bit_npz())
    with pytest.raises(ValueError, match=r"stem.conv.weight is \(32, 3, 7, 7\) in the checkpoint but \(64, 3, 7, 7\) in BiT-mu"):
        vitcore.load_npz(vitcore.create_model("BiT-mu", layers=LAYERS, width=64, num_classes=CLASSES), bit_npz())


def test_timm_state_dict_loads_unchanged_with_timm_epsilon():
    """A state dict in timm's names (resnetv2_*_bit) loads as is, and timm's 1e-8 epsilon is set."""
    source = model()
    vitcore.load_npz(source, bit_npz())
    timm_sd = {f"module.{k}": v.clone() for k, v in source.state_dict().items()}
    target = model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = vitcore.load_timm_state_dict(target, timm_sd)
    assert report.unused == [] and sorted(report.loaded) == sorted(source.state_dict())
    assert target.config.ws_eps == 1e-8 and target.stem.conv.eps == 1e-8
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(target(x), source(x), rtol=1e-4, atol=1e-4)
