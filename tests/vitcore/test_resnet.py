"""BiT ResNets (vitcore/resnet.py): the paper's convolutional baselines behind the ViT's interface."""

import pytest
import torch

import vitcore
from vitcore.resnet import StdConv2d

# timm 1.0.31 `resnetv2_*_bit` at 1,000 classes (counted with timm).
TIMM_PARAM_COUNTS = {
    "BiT-R50x1": 25_549_352, "BiT-R50x3": 217_319_080, "BiT-R101x1": 44_541_480,
    "BiT-R101x3": 387_934_888, "BiT-R152x2": 236_335_208, "BiT-R152x4": 936_533_224,
}


def tiny(**kw):
    kw.setdefault("img_size", 32)
    kw.setdefault("num_classes", 7)
    return vitcore.create_model(kw.pop("variant", "BiT-mu"), **kw)


@pytest.mark.parametrize("variant", list(TIMM_PARAM_COUNTS))
def test_parameter_count_matches_timm(variant):
    with torch.device("meta"):
        model = vitcore.create_model(variant)
    assert sum(p.numel() for p in model.parameters()) == TIMM_PARAM_COUNTS[variant]


def test_published_rounded_counts():
    """timm's model cards: resnetv2_50x1_bit 25.5M, resnetv2_152x2_bit 236.3M."""
    with torch.device("meta"):
        counts = {v: sum(p.numel() for p in vitcore.create_model(v).parameters())
                  for v in ("BiT-R50x1", "BiT-R152x2")}
    assert round(counts["BiT-R50x1"] / 1e6, 1) == 25.5
    assert round(counts["BiT-R152x2"] / 1e6, 1) == 236.3


@pytest.mark.parametrize("variant,size", [("BiT-mu", 32), ("BiT-mu", (40, 56)), ("BiT-Ti", 64)])
def test_forward_shapes_and_named_intermediates(variant, size):
    model = tiny(variant=variant, img_size=size)
    h, w = (size, size) if isinstance(size, int) else size
    logits, out = model(torch.rand(2, 3, h, w) * 2 - 1, return_intermediates=True)
    assert logits.shape == (2, 7)
    assert list(out) == ["stem", "stage1", "stage2", "stage3", "stage4", "encoded", "pre_logits", "logits"]
    assert out["stem"].shape == (2, 32, -(-h // 4), -(-w // 4))
    assert out["encoded"].shape == (2, 1024, -(-h // 32), -(-w // 32))
    assert out["pre_logits"].shape == (2, 1024) == (2, model.representation_dim)
    torch.testing.assert_close(out["pre_logits"], out["encoded"].mean(dim=(2, 3)))
    assert (out["encoded"] >= 0).all()  # the final GroupNorm is followed by ReLU
    torch.testing.assert_close(model.forward_features(torch.zeros(1, 3, h, w)).mean(dim=(2, 3)),
                               model(torch.zeros(1, 3, h, w), return_intermediates=True)[1]["pre_logits"])


def test_width_factor_multiplies_every_stage():
    with torch.device("meta"):
        x1, x2 = vitcore.create_model("BiT-R50x1"), vitcore.create_model("BiT-R50x2")
    assert x2.stem.conv.out_channels == 2 * x1.stem.conv.out_channels == 128
    for s1, s2 in zip(x1.stages, x2.stages):
        assert s2.blocks[0].conv2.out_channels == 2 * s1.blocks[0].conv2.out_channels
        assert s2.blocks[0].conv3.out_channels == 2 * s1.blocks[0].conv3.out_channels
    assert [len(s.blocks) for s in x1.stages] == [3, 4, 6, 3]


def test_convolutions_are_weight_standardised():
    conv = StdConv2d(4, 6, 3)
    with torch.no_grad():
        conv.weight.mul_(5).add_(2)
    w = conv.weight
    mean, var = w.mean((1, 2, 3), keepdim=True), w.var((1, 2, 3), keepdim=True, unbiased=False)
    x = torch.randn(1, 4, 5, 5)
    expected = torch.nn.functional.conv2d(x, (w - mean) / (var + 1e-10).sqrt(), padding=1)
    torch.testing.assert_close(conv(x), expected)
    # Scaling or shifting a kernel changes nothing: only its standardised form is applied.
    y = conv(x)
    with torch.no_grad():
        conv.weight.mul_(3).add_(-1)
    torch.testing.assert_close(conv(x), y, atol=1e-5, rtol=1e-5)


def test_every_conv_is_standardised_and_every_norm_is_group_norm_of_32():
    model = tiny()
    convs = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d) and not n.startswith("head")]
    assert convs and all(isinstance(m, StdConv2d) for m in convs)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert len(norms) == 3 * 4 + 1 and all(m.num_groups == 32 for m in norms)
    assert not any(isinstance(m, (torch.nn.BatchNorm2d, torch.nn.LayerNorm)) for m in model.modules())


def test_head_is_zero_initialised_so_logits_start_at_the_bias():
    model = tiny(head_bias_init=-10.0)
    assert torch.count_nonzero(model.head.fc.weight) == 0
    assert torch.equal(model(torch.rand(3, 3, 32, 32)), torch.full((3, 7), -10.0))


def test_timm_state_dict_names_and_shapes():
    model = vitcore.create_model("BiT-mu", layers=(2, 1), num_classes=10, img_size=32)
    expected = {
        "stem.conv.weight": (32, 3, 7, 7),
        "stages.0.blocks.0.downsample.conv.weight": (128, 32, 1, 1),
        "stages.0.blocks.0.norm1.weight": (32,), "stages.0.blocks.0.norm1.bias": (32,),
        "stages.0.blocks.0.conv1.weight": (32, 32, 1, 1),
        "stages.0.blocks.0.norm2.weight": (32,), "stages.0.blocks.0.norm2.bias": (32,),
        "stages.0.blocks.0.conv2.weight": (32, 32, 3, 3),
        "stages.0.blocks.0.norm3.weight": (32,), "stages.0.blocks.0.norm3.bias": (32,),
        "stages.0.blocks.0.conv3.weight": (128, 32, 1, 1),
        "stages.0.blocks.1.norm1.weight": (128,), "stages.0.blocks.1.norm1.bias": (128,),
        "stages.0.blocks.1.conv1.weight": (32, 128, 1, 1),
        "stages.0.blocks.1.norm2.weight": (32,), "stages.0.blocks.1.norm2.bias": (32,),
        "stages.0.blocks.1.conv2.weight": (32, 32, 3, 3),
        "stages.0.blocks.1.norm3.weight": (32,), "stages.0.blocks.1.norm3.bias": (32,),
        "stages.0.blocks.1.conv3.weight": (128, 32, 1, 1),
        "stages.1.blocks.0.downsample.conv.weight": (256, 128, 1, 1),
        "stages.1.blocks.0.norm1.weight": (128,), "stages.1.blocks.0.norm1.bias": (128,),
        "stages.1.blocks.0.conv1.weight": (64, 128, 1, 1),
        "stages.1.blocks.0.norm2.weight": (64,), "stages.1.blocks.0.norm2.bias": (64,),
        "stages.1.blocks.0.conv2.weight": (64, 64, 3, 3),
        "stages.1.blocks.0.norm3.weight": (64,), "stages.1.blocks.0.norm3.bias": (64,),
        "stages.1.blocks.0.conv3.weight": (256, 64, 1, 1),
        "norm.weight": (256,), "norm.bias": (256,),
        "head.fc.weight": (10, 256, 1, 1), "head.fc.bias": (10,),
    }
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected


def test_model_names_what_it_lacks_for_the_inspection_figures():
    resnet = tiny()
    assert resnet.lacks == set(vitcore.INSPECTION_PARTS) == {"embedding_filters", "position_embeddings", "attention"}
    assert vitcore.create_model("mu/8", img_size=32).lacks == set()
    assert vitcore.create_model("mu/8", img_size=32, posemb="relative").lacks == {"position_embeddings"}
    with pytest.raises(ValueError, match="BiT-mu has no attention to inspect .*skip this figure"):
        vitcore.mean_attention_distance(resnet, torch.zeros(1, 3, 32, 32))
    with pytest.raises(ValueError, match="BiT-mu has no position embeddings"):
        vitcore.position_embedding_similarity(resnet)
    with pytest.raises(ValueError, match="no attention maps \\('attention' is in model.lacks\\)"):
        resnet(torch.zeros(1, 3, 32, 32), return_attention=True)


def test_reset_head_and_representations_work_as_for_a_vit():
    model = tiny(num_classes=1000, head_bias_init=-10.0)
    vitcore.reset_head(model, 3)
    assert model.head.fc.weight.shape == (3, 1024, 1, 1) and torch.count_nonzero(model.head.fc.bias) == 0
    assert model.config.num_classes == 3
    feats = vitcore.compute_representations(model, torch.rand(5, 3, 32, 32), batch_size=2)
    assert feats.shape == (5, 1024)
    assert tiny(num_classes=0)(torch.zeros(2, 3, 32, 32)).shape == (2, 1024)


def test_bad_names_options_and_inputs_are_refused_in_one_line():
    with pytest.raises(ValueError, match="no BiT ResNet of depth 34; accepted depths are 26, 50, 101, 152, 200"):
        vitcore.create_model("BiT-R34x1")
    with pytest.raises(ValueError, match="not of the form 'BiT-R<depth>x<k>'"):
        vitcore.create_model("BiT-50")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['dropout'\] for a BiT ResNet"):
        tiny(dropout=0.1)
    with pytest.raises(ValueError, match="pools by global average .*drop classifier='token'"):
        tiny(classifier="token")
    with pytest.raises(ValueError, match="width=48 must be a positive multiple of 32"):
        tiny(width=48)
    with pytest.raises(ValueError, match=r"BiT-mu: expected images of shape \(B, 3, H, W\), got \(1, 1, 32, 32\)"):
        tiny()(torch.zeros(1, 1, 32, 32))


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = tiny(variant="BiT-Ti", num_classes=3)
    ckpt = tiny(variant="BiT-Ti", num_classes=3, grad_checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    for m in (plain, ckpt):
        torch.nn.init.normal_(m.head.fc.weight, std=0.1)
    ckpt.head.fc.weight.data.copy_(plain.head.fc.weight.data)
    x = torch.rand(2, 3, 32, 32)
    for m in (plain, ckpt):
        m.train()
        m(x).square().sum().backward()
    torch.testing.assert_close(ckpt.stem.conv.weight.grad, plain.stem.conv.weight.grad)


def test_masked_patch_prediction_refuses_a_resnet():
    with pytest.raises(TypeError, match="ResNetV2 has none, so pre-train it with a classification loss"):
        vitcore.MaskedPatchPrediction(tiny())
