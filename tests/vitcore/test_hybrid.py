import torch

from vitcore.hybrid import ResNetBackbone, StdConv2d, same_padding


def test_same_padding_is_flax_asymmetric():
    assert same_padding(224, 7, 2) == (2, 3)  # extra pixel after, as TF/Flax
    assert same_padding(112, 3, 2) == (0, 1)
    assert same_padding(56, 3, 1) == (1, 1)
    assert same_padding(56, 1, 2) == (0, 0)


def test_std_conv_standardises_each_output_filter():
    conv = StdConv2d(4, 6, 3)
    with torch.no_grad():
        conv.weight.mul_(5).add_(2)
    x = torch.randn(1, 4, 5, 5)
    w = conv.weight
    w_std = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True, unbiased=False) + 1e-5)
    expected = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (1, 1, 1, 1)), w_std)
    torch.testing.assert_close(conv(x), expected)


def test_r50_hybrid_stem_has_stride_16_and_1024_channels():
    with torch.device("meta"):
        backbone = ResNetBackbone((3, 4, 9))
    assert backbone.out_channels == 1024
    assert backbone(torch.empty(1, 3, 224, 224, device="meta")).shape == (1, 1024, 14, 14)
    assert [len(s.blocks) for s in backbone.stages] == [3, 4, 9]
