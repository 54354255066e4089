import pytest
import torch
from torch import nn

import vitcore
from vitcore.model import Attention
from vitcore.variants import decode_bit_variant


def test_b16_macs_match_published_figures():
    assert vitcore.count_macs("B/16") == pytest.approx(17.58e9, rel=2e-3)
    assert vitcore.count_macs("B/16", img_size=384) == pytest.approx(55.5e9, rel=2e-3)
    assert vitcore.train_flops_per_image("B/16") == pytest.approx(105.5e9, rel=2e-3)


def hooked_macs(model, img_size):
    """Count MACs by observing every conv, linear and attention call on a real forward."""
    total = [0]

    def conv(m, inp, out):
        total[0] += out[0].numel() * m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1]

    def linear(m, inp, out):
        total[0] += out[0].numel() * m.in_features

    def attn(m, inp, out):
        _, seq, dim = inp[0].shape
        total[0] += 2 * seq * seq * dim
        if m.rel_pos is not None:
            total[0] += seq * (2 * seq - 1) * dim
    for mod in model.modules():
        if isinstance(mod, nn.Conv2d):
            mod.register_forward_hook(conv)
        elif isinstance(mod, nn.Linear):
            mod.register_forward_hook(linear)
        elif isinstance(mod, Attention):
            mod.register_forward_hook(attn)
    with torch.no_grad():
        model(torch.zeros(1, 3, *img_size))
    return total[0]


@pytest.mark.parametrize("variant,kw", [("mu/8", dict(img_size=(32, 48), representation_size=16)),
                                        ("mu/8", dict(img_size=32, posemb="relative", classifier="gap")),
                                        ("R50+B/16", dict(img_size=64, depth=1, width=64, num_heads=2, mlp_dim=32)),
                                        ("BiT-Ti", dict(img_size=(40, 56))),
                                        ("BiT-mu", dict(img_size=64, layers=(2, 1, 3), width=64))])
def test_analytic_count_equals_observed_count(variant, kw):
    model = vitcore.create_model(variant, num_classes=7, **kw)
    assert vitcore.count_macs(model) == hooked_macs(model, model.config.img_size)


def test_bf16_peaks():
    assert vitcore.bf16_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert vitcore.bf16_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert vitcore.bf16_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert vitcore.bf16_peak_flops("NVIDIA H200") == 989e12
    assert vitcore.bf16_peak_flops("Tesla T4") is None


# Table 6: (JFT-300M pre-training epochs, exaFLOPs). Section 4.1: JFT has 303M images and 18k
# classes; models pre-train at 224 px. exaFLOPs = images x epochs x training FLOPs per image.
TABLE6 = {"B/32": (7, 55), "B/16": (7, 224), "L/32": (7, 196), "L/16": (7, 783), "H/14": (14, 4262),
          "BiT-R50x1": (7, 50), "BiT-R50x2": (7, 199), "BiT-R101x1": (7, 96), "BiT-R152x1": (7, 141),
          "BiT-R152x2": (7, 563), "BiT-R200x3": (14, 3306)}


@pytest.mark.parametrize("variant", list(TABLE6))
def test_pretraining_compute_matches_table6(variant):
    epochs, exaflops = TABLE6[variant]
    per_image = vitcore.train_flops_per_image(variant, img_size=224, num_classes=18_000)
    # Ours is within 0.2% for the ViTs (B/32's 55 is rounded: +2.3%) and 3.5-5% above the paper
    # for the ResNets. vitcore counts every tap of a padded conv, as the hardware runs it; leaving
    # out the taps that fall on zero padding brings every ResNet within 1.5% of Table 6.
    assert per_image * 303e6 * epochs / 1e18 == pytest.approx(exaflops, rel=0.05)


def _taps_off_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """(kernel taps that land inside the input, summed over outputs; output size) along one axis."""
    pad = kernel // 2
    out = (size + 2 * pad - kernel) // stride + 1
    return sum(0 <= o * stride - pad + i < size for o in range(out) for i in range(kernel)), out


def _bit_macs_without_padding(variant: str, size: int = 224, num_classes: int = 18_000) -> int:
    spec = decode_bit_variant(variant)
    width = spec["width"]
    t, size = _taps_off_padding(size, 7, 2)
    macs = t * t * 3 * width
    size, in_ch = _taps_off_padding(size, 3, 2)[1], width
    for i, units in enumerate(spec["layers"]):
        f = width * 2 ** i
        for u in range(units):
            taps, out = _taps_off_padding(size, 3, 2 if i and not u else 1)
            macs += size * size * in_ch * f + taps * taps * f * f + out * out * f * 4 * f
            macs += out * out * in_ch * 4 * f if not u else 0
            size, in_ch = out, 4 * f
    return macs + in_ch * num_classes


@pytest.mark.parametrize("variant", [v for v in TABLE6 if v.startswith("BiT-")])
def test_resnet_gap_to_table6_is_the_taps_on_zero_padding(variant):
    epochs, exaflops = TABLE6[variant]
    assert 6 * _bit_macs_without_padding(variant) * 303e6 * epochs / 1e18 == pytest.approx(exaflops, rel=0.015)
