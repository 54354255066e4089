import pytest
import torch

import vitcore
from vitcore.variants import decode_bit_variant, decode_variant


def test_table1_variants_decode_to_paper_sizes():
    assert decode_variant("B/16") == dict(width=768, depth=12, mlp_dim=3072, num_heads=12,
                                          patch_size=16, resnet_layers=None)
    for name, (w, d, m, h) in {"L/16": (1024, 24, 4096, 16), "H/14": (1280, 32, 5120, 16),
                               "mu/8": (32, 1, 128, 2)}.items():
        spec = decode_variant(name)
        assert (spec["width"], spec["depth"], spec["mlp_dim"], spec["num_heads"]) == (w, d, m, h)


def test_hybrid_decodes_to_r50_stages_and_stride():
    spec = decode_variant("R50+B/16")
    assert spec["resnet_layers"] == (3, 4, 9) and spec["patch_size"] == 16


def test_unknown_variant_names_the_accepted_ones():
    with pytest.raises(ValueError, match="accepted sizes are mu, Ti, S"):
        decode_variant("X/16")
    with pytest.raises(ValueError, match="SIZE/PATCH"):
        vitcore.create_model("B16")
    with pytest.raises(ValueError, match="accepted hybrids"):
        decode_variant("R50+B/8")


def test_options_override_the_table():
    model = vitcore.create_model("Ti/8", img_size=32, depth=2, num_classes=10)
    assert len(model.blocks) == 2 and model.config.width == 192
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 10)


def test_unknown_option_is_named_with_the_accepted_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['layers'\].*accepted options are depth, width"):
        vitcore.create_model("mu/8", img_size=32, layers=3)


def test_image_size_must_be_a_patch_multiple():
    with pytest.raises(ValueError, match="not a multiple of the patch size 16"):
        vitcore.create_model("mu/16", img_size=40)


def test_bit_names_decode_to_stage_depths_and_widths():
    expected = {"BiT-R26x1": ((2, 2, 2, 2), 64), "BiT-R50x1": ((3, 4, 6, 3), 64), "BiT-R50x2": ((3, 4, 6, 3), 128),
                "BiT-R101x1": ((3, 4, 23, 3), 64), "BiT-R101x3": ((3, 4, 23, 3), 192),
                "BiT-R152x1": ((3, 8, 36, 3), 64), "BiT-R152x2": ((3, 8, 36, 3), 128),
                "BiT-R152x4": ((3, 8, 36, 3), 256), "BiT-R200x3": ((3, 24, 36, 3), 192)}
    for name, (layers, width) in expected.items():
        assert decode_bit_variant(name) == dict(layers=layers, width=width)
        assert name in vitcore.accepted_variants() and vitcore.is_bit_variant(name)
    assert not vitcore.is_bit_variant("R50+B/16")
    assert decode_bit_variant("BiT-mu") == dict(layers=(1, 1, 1, 1), width=32)


def test_vit_decoder_refuses_a_bit_name_in_one_line():
    """Stage configs read a ViT's patch size from decode_variant; a ResNet name must not slip past as a KeyError."""
    with pytest.raises(ValueError, match="'BiT-R50x1' is a BiT ResNet, not a ViT"):
        decode_variant("BiT-R50x1")
