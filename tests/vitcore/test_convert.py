"""The `.npz` and timm loaders, checked against an independent NumPy re-implementation of
the official Flax forward pass (vit_jax models_vit.py / models_resnet.py) on synthetic
checkpoints written in the official key layouts."""

import numpy as np
import pytest
import torch

import vitcore
from vitcore.model import VisionTransformer, ViTConfig

# ---------------------------------------------------------------- NumPy reference of the Flax math


def np_layernorm(x, scale, bias, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


def np_gelu_tanh(x):  # flax.linen.gelu(approximate=True), the default
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def np_conv(x, kernel, stride, padding):
    """NHWC input, HWIO kernel, Flax/TF 'SAME' or 'VALID' padding."""
    kh, kw = kernel.shape[:2]
    n, h, w, _ = x.shape
    if padding == "SAME":
        oh, ow = -(-h // stride), -(-w // stride)
        ph = max((oh - 1) * stride + kh - h, 0)
        pw = max((ow - 1) * stride + kw - w, 0)
        x = np.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
    else:
        oh, ow = (h - kh) // stride + 1, (w - kw) // stride + 1
    out = np.zeros((n, oh, ow, kernel.shape[-1]))
    for i in range(kh):
        for j in range(kw):
            out += x[:, i:i + stride * oh:stride, j:j + stride * ow:stride, :] @ kernel[i, j]
    return out


def np_std_conv(x, kernel, stride):
    mean = kernel.mean(axis=(0, 1, 2))
    std = kernel.std(axis=(0, 1, 2))
    return np_conv(x, (kernel - mean) / (std + 1e-5), stride, "SAME")


def np_group_norm(x, scale, bias, groups=32, eps=1e-6):
    n, h, w, c = x.shape
    g = x.reshape(n, h, w, groups, c // groups)
    mean = g.mean(axis=(1, 2, 4), keepdims=True)
    var = g.var(axis=(1, 2, 4), keepdims=True)
    return ((g - mean) / np.sqrt(var + eps)).reshape(n, h, w, c) * scale + bias


def np_max_pool_same(x, k=3, s=2):
    n, h, w, c = x.shape
    oh, ow = -(-h // s), -(-w // s)
    ph, pw = max((oh - 1) * s + k - h, 0), max((ow - 1) * s + k - w, 0)
    x = np.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)), constant_values=-np.inf)
    out = np.full((n, oh, ow, c), -np.inf)
    for i in range(k):
        for j in range(k):
            out = np.maximum(out, x[:, i:i + s * oh:s, j:j + s * ow:s])
    return out


def np_resnet(p, x, layers):
    relu = lambda t: np.maximum(t, 0)  # noqa: E731
    x = relu(np_group_norm(np_std_conv(x, p["conv_root/kernel"], 2), p["gn_root/scale"], p["gn_root/bias"]))
    x = np_max_pool_same(x)
    for s, depth in enumerate(layers):
        for u in range(depth):
            pre = f"block{s + 1}/unit{u + 1}/"
            stride = 2 if (s > 0 and u == 0) else 1
            res = x
            if pre + "conv_proj/kernel" in p:
                res = np_group_norm(np_std_conv(x, p[pre + "conv_proj/kernel"], stride),
                                    p[pre + "gn_proj/scale"], p[pre + "gn_proj/bias"])
            y = relu(np_group_norm(np_std_conv(x, p[pre + "conv1/kernel"], 1), p[pre + "gn1/scale"], p[pre + "gn1/bias"]))
            y = relu(np_group_norm(np_std_conv(y, p[pre + "conv2/kernel"], stride), p[pre + "gn2/scale"], p[pre + "gn2/bias"]))
            y = np_group_norm(np_std_conv(y, p[pre + "conv3/kernel"], 1), p[pre + "gn3/scale"], p[pre + "gn3/bias"])
            x = relu(res + y)
    return x


def np_vit(p, images_nchw, *, big_vision=False, resnet_layers=None):
    """Flax ViT forward on a dict of checkpoint arrays (no prefixes, unscanned)."""
    names = (("LayerNorm_0", "MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0") if big_vision
             else ("LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3"))
    x = images_nchw.transpose(0, 2, 3, 1).astype(np.float64)
    if resnet_layers:
        x = np_resnet(p, x, resnet_layers)
    k = p["embedding/kernel"]
    x = np_conv(x, k, k.shape[0], "VALID") + p["embedding/bias"]
    n, h, w, c = x.shape
    x = x.reshape(n, h * w, c)
    cls = np.broadcast_to(p["cls"], (n, 1, c)) if "cls" in p else None
    if big_vision:
        x = x + p["pos_embedding"]
        if cls is not None:
            x = np.concatenate([cls, x], 1)
    else:
        if cls is not None:
            x = np.concatenate([cls, x], 1)
        x = x + p["Transformer/posembed_input/pos_embedding"]
    i = 0
    while f"Transformer/encoderblock_{i}/{names[0]}/scale" in p:
        b = f"Transformer/encoderblock_{i}/"
        a = b + names[1] + "/"
        y = np_layernorm(x, p[b + names[0] + "/scale"], p[b + names[0] + "/bias"])
        q = np.einsum("...d,dhk->...hk", y, p[a + "query/kernel"]) + p[a + "query/bias"]
        kk = np.einsum("...d,dhk->...hk", y, p[a + "key/kernel"]) + p[a + "key/bias"]
        v = np.einsum("...d,dhk->...hk", y, p[a + "value/kernel"]) + p[a + "value/bias"]
        q = q / np.sqrt(q.shape[-1])  # flax dot_product_attention scales the query
        logits = np.einsum("...qhd,...khd->...hqk", q, kk)
        wts = np.exp(logits - logits.max(-1, keepdims=True))
        wts = wts / wts.sum(-1, keepdims=True)
        o = np.einsum("...hqk,...khd->...qhd", wts, v)
        x = x + np.einsum("...hd,hdD->...D", o, p[a + "out/kernel"]) + p[a + "out/bias"]
        y = np_layernorm(x, p[b + names[2] + "/scale"], p[b + names[2] + "/bias"])
        m = b + names[3] + "/"
        y = np_gelu_tanh(y @ p[m + "Dense_0/kernel"] + p[m + "Dense_0/bias"])
        x = x + y @ p[m + "Dense_1/kernel"] + p[m + "Dense_1/bias"]
        i += 1
    x = np_layernorm(x, p["Transformer/encoder_norm/scale"], p["Transformer/encoder_norm/bias"])
    x = x[:, 0] if "cls" in p else x.mean(1)
    if "pre_logits/kernel" in p:
        x = np.tanh(x @ p["pre_logits/kernel"] + p["pre_logits/bias"])
    return x @ p["head/kernel"] + p["head/bias"] if "head/kernel" in p else x


# ---------------------------------------------------------------- synthetic official checkpoints


def make_vit_jax_params(seed=0, *, width=32, depth=2, heads=4, mlp=64, patch=8, grid=(4, 4), classes=5,
                        representation=None, token=True, head=True, resnet_layers=None):
    rng = np.random.default_rng(seed)

    def r(*shape, s=0.2):
        return rng.normal(scale=s, size=shape).astype(np.float32)
    hd = width // heads
    in_ch, kp = 3, patch
    p = {}
    if resnet_layers:
        p["conv_root/kernel"] = r(7, 7, 3, 64)
        p["gn_root/scale"], p["gn_root/bias"] = 1 + r(64, s=0.1), r(64, s=0.1)
        cin = 64
        for s, d in enumerate(resnet_layers):
            f = 64 * 2 ** s
            for u in range(d):
                pre = f"block{s + 1}/unit{u + 1}/"
                if u == 0:
                    p[pre + "conv_proj/kernel"] = r(1, 1, cin, 4 * f)
                    p[pre + "gn_proj/scale"], p[pre + "gn_proj/bias"] = 1 + r(4 * f, s=0.1), r(4 * f, s=0.1)
                for name, shape in (("conv1", (1, 1, cin, f)), ("conv2", (3, 3, f, f)), ("conv3", (1, 1, f, 4 * f))):
                    p[pre + name + "/kernel"] = r(*shape)
                    gn = name.replace("conv", "gn")
                    p[pre + gn + "/scale"], p[pre + gn + "/bias"] = 1 + r(shape[-1], s=0.1), r(shape[-1], s=0.1)
                cin = 4 * f
        in_ch, kp = cin, 1
    p["embedding/kernel"] = r(kp, kp, in_ch, width, s=0.05 if resnet_layers else 0.2)
    p["embedding/bias"] = r(width)
    n = grid[0] * grid[1]
    if token:
        p["cls"] = r(1, 1, width)
    p["Transformer/posembed_input/pos_embedding"] = r(1, n + token, width)
    for i in range(depth):
        b = f"Transformer/encoderblock_{i}/"
        for ln in ("LayerNorm_0", "LayerNorm_2"):
            p[b + ln + "/scale"], p[b + ln + "/bias"] = 1 + r(width, s=0.1), r(width, s=0.1)
        a = b + "MultiHeadDotProductAttention_1/"
        for part in ("query", "key", "value"):
            p[a + part + "/kernel"], p[a + part + "/bias"] = r(width, heads, hd), r(heads, hd)
        p[a + "out/kernel"], p[a + "out/bias"] = r(heads, hd, width), r(width)
        m = b + "MlpBlock_3/"
        p[m + "Dense_0/kernel"], p[m + "Dense_0/bias"] = r(width, mlp), r(mlp)
        p[m + "Dense_1/kernel"], p[m + "Dense_1/bias"] = r(mlp, width), r(width)
    p["Transformer/encoder_norm/scale"] = 1 + r(width, s=0.1)
    p["Transformer/encoder_norm/bias"] = r(width, s=0.1)
    rep = representation or width
    if representation:
        p["pre_logits/kernel"], p["pre_logits/bias"] = r(width, representation), r(representation)
    if head:
        p["head/kernel"], p["head/bias"] = r(rep, classes), r(classes)
    return p


def to_big_vision(p, *, scan=False):
    """Rename to big_vision's layout: per-type module counters and a top-level position
    embedding without a class slot (added before [class] is concatenated)."""
    out = {}
    for k, v in p.items():
        k = (k.replace("MultiHeadDotProductAttention_1", "MultiHeadDotProductAttention_0")
             .replace("LayerNorm_2", "LayerNorm_1").replace("MlpBlock_3", "MlpBlock_0"))
        if k == "Transformer/posembed_input/pos_embedding":
            k, v = "pos_embedding", v[:, 1:] if "cls" in p else v
        out[k] = v
    if scan:
        blocks = sorted({k.split("/")[1] for k in out if k.startswith("Transformer/encoderblock_")},
                        key=lambda s: int(s.rsplit("_", 1)[1]))
        rest = {k: v for k, v in out.items() if not k.startswith("Transformer/encoderblock_")}
        for sub in [k[len("Transformer/encoderblock_0/"):] for k in out if k.startswith("Transformer/encoderblock_0/")]:
            rest["Transformer/encoderblock/" + sub] = np.stack([out[f"Transformer/{b}/{sub}"] for b in blocks])
        out = rest
    return out


def tiny_model(**kw):
    kw.setdefault("img_size", 32)
    kw.setdefault("num_classes", 5)
    return vitcore.create_model("mu/8", width=32, depth=2, num_heads=4, mlp_dim=64, **kw).eval()


def images(n=2, size=32, seed=1):
    return np.random.default_rng(seed).uniform(-1, 1, size=(n, 3, size, size)).astype(np.float32)


def run(model, x):
    with torch.no_grad():
        return model(torch.from_numpy(x)).double().numpy()


# ---------------------------------------------------------------- .npz tests


@pytest.mark.parametrize("representation", [None, 32])
def test_npz_with_opt_target_prefix_reproduces_flax_outputs(tmp_path, representation):
    params = make_vit_jax_params(representation=representation)
    path = tmp_path / "vit.npz"
    np.savez(path, **{"opt/target/" + k: v for k, v in params.items()})
    model = tiny_model(gelu="erf", representation_size=representation)
    report = vitcore.load_npz(model, path)
    assert model.config.gelu == "tanh" and report.unused == []
    x = images()
    np.testing.assert_allclose(run(model, x), np_vit(params, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scan", [False, True])
def test_big_vision_layout_without_class_slot_reproduces_its_outputs(tmp_path, scan):
    params = to_big_vision(make_vit_jax_params(seed=3), scan=scan)
    assert params["pos_embedding"].shape == (1, 16, 32)
    path = tmp_path / "bv.npz"
    np.savez(path, **{"params/" + k: v for k, v in params.items()})
    model = tiny_model()
    report = vitcore.load_npz(model, path)
    assert "big_vision" in report.source
    x = images()
    unscanned = to_big_vision(make_vit_jax_params(seed=3))
    np.testing.assert_allclose(run(model, x), np_vit(unscanned, x, big_vision=True), rtol=1e-4, atol=1e-4)


def test_gap_checkpoint_without_class_token():
    params = make_vit_jax_params(seed=4, token=False)
    model = tiny_model(classifier="gap")
    vitcore.load_npz(model, params)
    x = images()
    np.testing.assert_allclose(run(model, x), np_vit(params, x), rtol=1e-4, atol=1e-4)


def test_r50_hybrid_npz_reproduces_flax_outputs():
    layers = (1, 1, 1)  # three stages = stride 16, like R50+B/16, but one unit each
    params = make_vit_jax_params(seed=5, resnet_layers=layers, patch=16, grid=(2, 2))
    cfg = ViTConfig(variant="R?+mu/16", width=32, depth=2, mlp_dim=64, num_heads=4, patch_size=16,
                    resnet_layers=layers, img_size=(32, 32), num_classes=5)
    model = VisionTransformer(cfg).eval()
    report = vitcore.load_npz(model, params)
    assert report.unused == [] and not [k for k in report.skipped]
    x = images()
    np.testing.assert_allclose(run(model, x), np_vit(params, x, resnet_layers=layers), rtol=1e-4, atol=1e-4)


def test_mismatched_head_stays_zero_with_a_warning():
    params = make_vit_jax_params(classes=5)
    model = tiny_model(num_classes=10)
    with pytest.warns(UserWarning, match="head shape does not match"):
        report = vitcore.load_npz(model, params)
    assert "head.weight" in report.skipped and torch.count_nonzero(model.head.weight) == 0
    torch.testing.assert_close(model.norm.weight, torch.from_numpy(params["Transformer/encoder_norm/scale"]))


def test_checkpoint_without_head_and_pre_logits_into_fine_tuning_model():
    params = make_vit_jax_params(representation=32, head=False)
    model = tiny_model()
    report = vitcore.load_npz(model, params)
    assert report.skipped["pre_logits.fc.weight"].startswith("model has no pre-logits layer")
    assert report.skipped["head.weight"] == "not in the checkpoint"
    with torch.no_grad():
        _, out = model(torch.from_numpy(images()), return_intermediates=True)
    ref = make_vit_jax_params(representation=None, head=False)  # same seed: same body, no pre_logits
    np.testing.assert_allclose(out["pre_logits"].double().numpy(), np_vit(ref, images()), rtol=1e-4, atol=1e-4)


def test_loading_at_higher_resolution_interpolates_position_embeddings():
    params = make_vit_jax_params()
    model = tiny_model(img_size=48)  # grid 4x4 -> 6x6
    report = vitcore.load_npz(model, params)
    assert report.resized["pos_embed"].startswith("grid 4x4 -> 6x6")
    posemb = torch.from_numpy(params["Transformer/posembed_input/pos_embedding"])
    expected = vitcore.adapt_pos_embed(posemb, new_grid=(6, 6), new_prefix=1, old_prefix=1)
    torch.testing.assert_close(model.pos_embed.data, expected)


def test_wrong_variant_is_refused_with_the_shapes():
    params = make_vit_jax_params(width=32, mlp=64)
    model = vitcore.create_model("mu/8", img_size=32, num_classes=5, depth=2, num_heads=4, mlp_dim=128)
    with pytest.raises(ValueError, match=r"blocks.0.mlp.fc1.weight is \(64, 32\) in the checkpoint but \(128, 32\)"):
        vitcore.load_npz(model, params)


def test_corrupt_npz_file_is_reported(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="bad.npz: not a readable .npz"):
        vitcore.load_npz(tiny_model(), bad)
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        vitcore.load_npz(tiny_model(), tmp_path / "missing.npz")


def test_checkpoint_without_position_embedding_names_the_fix():
    params = to_big_vision(make_vit_jax_params())
    del params["pos_embedding"]  # big_vision models with posemb='sincos2d' store none
    with pytest.raises(ValueError, match="posemb='sincos2d'"):
        vitcore.load_npz(tiny_model(), params)
    vitcore.load_npz(tiny_model(posemb="sincos2d"), params)


def test_unused_entries_are_reported():
    params = make_vit_jax_params()
    params["MAPHead_0/probe"] = np.zeros((1, 1, 32), np.float32)
    with pytest.warns(UserWarning, match="MAPHead_0/probe"):
        report = vitcore.load_npz(tiny_model(), params)
    assert report.unused == ["MAPHead_0/probe"]


# ---------------------------------------------------------------- timm layout


def random_timm_state_dict(seed=0, grid=4, width=32, depth=2, mlp=64, classes=5):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.2):
        return torch.randn(*shape, generator=g) * s
    sd = {"cls_token": r(1, 1, width), "pos_embed": r(1, grid * grid + 1, width),
          "patch_embed.proj.weight": r(width, 3, 8, 8), "patch_embed.proj.bias": r(width),
          "norm.weight": 1 + r(width, s=0.1), "norm.bias": r(width, s=0.1),
          "head.weight": r(classes, width), "head.bias": r(classes)}
    for i in range(depth):
        b = f"blocks.{i}."
        sd.update({b + "norm1.weight": 1 + r(width, s=0.1), b + "norm1.bias": r(width, s=0.1),
                   b + "attn.qkv.weight": r(3 * width, width), b + "attn.qkv.bias": r(3 * width),
                   b + "attn.proj.weight": r(width, width), b + "attn.proj.bias": r(width),
                   b + "norm2.weight": 1 + r(width, s=0.1), b + "norm2.bias": r(width, s=0.1),
                   b + "mlp.fc1.weight": r(mlp, width), b + "mlp.fc1.bias": r(mlp),
                   b + "mlp.fc2.weight": r(width, mlp), b + "mlp.fc2.bias": r(width)})
    return sd


def test_timm_state_dict_reproduces_timm_math_with_erf_gelu():
    sd = random_timm_state_dict()
    model = tiny_model()
    report = vitcore.load_timm_state_dict(model, {"module." + k: v for k, v in sd.items()})
    assert report.gelu == "erf" and model.config.gelu == "erf" and not report.skipped
    reference = vitcore.ReferenceViT(model.config)  # explicit fp32 math, erf GELU
    reference.load_state_dict(sd)
    x = torch.from_numpy(images())
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
        tanh_model = tiny_model(gelu="tanh")
        tanh_model.load_state_dict(model.state_dict())
        assert (tanh_model(x) - reference(x)).abs().max() > 1e-5  # the flavour matters


def test_timm_layout_round_trip_through_our_state_dict():
    torch.manual_seed(0)
    source = tiny_model(representation_size=32)
    for p in source.parameters():
        torch.nn.init.normal_(p, std=0.2)
    target = tiny_model(representation_size=32, gelu="erf")
    vitcore.load_timm_state_dict(target, source.state_dict())
    vitcore.set_gelu(source, "erf")
    x = torch.from_numpy(images())
    with torch.no_grad():
        torch.testing.assert_close(target(x), source(x))
    for k, v in source.state_dict().items():
        assert torch.equal(target.state_dict()[k], v), k


def test_timm_state_dict_into_another_resolution():
    sd = random_timm_state_dict(grid=4)
    model = tiny_model(img_size=64)
    report = vitcore.load_timm_state_dict(model, sd)
    assert "pos_embed" in report.resized
    expected = vitcore.adapt_pos_embed(sd["pos_embed"], new_grid=(8, 8), new_prefix=1, old_prefix=1)
    torch.testing.assert_close(model.pos_embed.data, expected)


def test_timm_variants_the_paper_lacks_are_refused():
    sd = random_timm_state_dict()
    sd["fc_norm.weight"] = torch.ones(32)
    with pytest.raises(ValueError, match="fc_norm"):
        vitcore.load_timm_state_dict(tiny_model(), sd)
