import pytest
import torch
from torch import nn

import vitcore

# vit_jax models_test.py: 1000 classes, 224 px, token pooling, no pre-logits.
OFFICIAL_PARAM_COUNTS = {
    "Ti/16": 5_717_416, "S/16": 22_050_664, "B/16": 86_567_656, "B/32": 88_224_232,
    "L/16": 304_326_632, "H/14": 632_045_800, "R50+B/16": 98_659_112,
}


def n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("variant", list(OFFICIAL_PARAM_COUNTS))
def test_parameter_count_matches_official_code(variant):
    with torch.device("meta"):
        model = vitcore.create_model(variant)
    assert n_params(model) == OFFICIAL_PARAM_COUNTS[variant]


def test_gap_without_class_token_matches_official_count():
    with torch.device("meta"):
        model = vitcore.create_model("B/16", classifier="gap")
    assert n_params(model) == 86_566_120


def tiny(**kw):
    kw.setdefault("img_size", 32)
    kw.setdefault("num_classes", 7)
    return vitcore.create_model(kw.pop("variant", "mu/8"), **kw)


@pytest.mark.parametrize("img_size", [16, 32, (24, 40), 64])
@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_logit_shape_at_several_resolutions(img_size, classifier):
    model = tiny(img_size=img_size, classifier=classifier, depth=2)
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    logits, out = model(torch.rand(3, 3, h, w) * 2 - 1, return_intermediates=True)
    n = (h // 8) * (w // 8) + (classifier == "token")
    assert logits.shape == (3, 7)
    assert out["encoded"].shape == (3, n, 32)
    assert out["pre_logits"].shape == (3, 32)


def test_wrong_input_resolution_explains_the_fix():
    with pytest.raises(ValueError, match="built for 32x32; build the model with img_size=\\(48, 48\\)"):
        tiny()(torch.zeros(1, 3, 48, 48))


def test_head_is_zero_initialised_and_pre_logits_is_tanh_layer():
    model = tiny(representation_size=32)
    assert torch.count_nonzero(model.head.weight) == 0
    _, out = model(torch.rand(2, 3, 32, 32), return_intermediates=True)
    assert out["pre_logits"].abs().max() <= 1  # tanh range
    assert isinstance(model.pre_logits.act, nn.Tanh)


def test_reset_head_replaces_whole_head_with_zero_linear():
    model = tiny(representation_size=32, num_classes=1000)
    nn.init.normal_(model.head.weight)
    vitcore.reset_head(model, 10)
    assert isinstance(model.pre_logits, nn.Identity)
    assert model.head.out_features == 10 and torch.count_nonzero(model.head.weight) == 0
    assert model.config.num_classes == 10 and model.config.representation_size is None
    assert torch.equal(model(torch.rand(2, 3, 32, 32)), torch.zeros(2, 10))


def test_forward_features_is_the_encoded_sequence():
    model = tiny().eval()
    x = torch.rand(2, 3, 32, 32)
    _, out = model(x, return_intermediates=True)
    torch.testing.assert_close(model.forward_features(x), out["encoded"])


def test_gap_pools_after_the_final_norm():
    model = tiny(classifier="gap").eval()
    _, out = model(torch.rand(2, 3, 32, 32), return_intermediates=True)
    torch.testing.assert_close(out["pre_logits"], out["encoded"].mean(1))


def test_dropout_sits_where_appendix_b1_puts_it():
    model = tiny(dropout=0.1, depth=1)
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Dropout)}
    assert names == {"pos_drop", "blocks.0.attn.proj_drop", "blocks.0.mlp.drop1", "blocks.0.mlp.drop2"}
    x = torch.rand(2, 3, 32, 32)
    nn.init.normal_(model.head.weight)
    model.train()
    assert not torch.equal(model(x), model(x))
    model.eval()
    assert torch.equal(model(x), model(x))


@pytest.mark.parametrize("posemb", ["learn", "relative", "2d", "sincos2d", "none"])
@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_fused_and_explicit_attention_agree(posemb, classifier):
    torch.manual_seed(0)
    fused = tiny(posemb=posemb, classifier=classifier, depth=2, width=32, num_heads=4, attn_impl="sdpa")
    explicit = tiny(posemb=posemb, classifier=classifier, depth=2, width=32, num_heads=4, attn_impl="explicit")
    for p in fused.parameters():
        nn.init.normal_(p, std=0.3)
    explicit.load_state_dict(fused.state_dict())
    x = torch.rand(3, 3, 32, 32) * 2 - 1
    a, b = fused(x), explicit(x)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    a.square().sum().backward()
    b.square().sum().backward()
    for (name, p), q in zip(fused.named_parameters(), explicit.parameters()):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_relative_position_logits_reach_the_table(impl):
    model = tiny(posemb="relative", attn_impl=impl)
    nn.init.normal_(model.head.weight)
    nn.init.normal_(model.cls_token)  # a zero [class] query would attend uniformly
    model(torch.rand(2, 3, 32, 32)).sum().backward()
    assert model.blocks[0].attn.rel_pos.rel_embed.grad.abs().sum() > 0


def test_position_embedding_kinds_have_their_parameters():
    assert tiny(posemb="none").pos_embed is None
    assert "pos_embed" not in tiny(posemb="sincos2d").state_dict()  # fixed, derived from the grid
    m2d = tiny(posemb="2d")
    assert m2d.pos_embed_2d.pos_embed_y.shape == (4, 16) and m2d.pos_embed_2d.pos_embed_x.shape == (4, 16)
    assert tiny(posemb="learn").pos_embed.shape == (1, 17, 32)


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = tiny(depth=2)
    ckpt = tiny(depth=2, grad_checkpointing=True)
    nn.init.normal_(plain.head.weight)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.rand(2, 3, 32, 32)
    plain(x).sum().backward()
    ckpt(x).sum().backward()
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_bf16_autocast_runs_in_bf16():
    model = tiny()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, out = model(torch.rand(2, 3, 32, 32), return_intermediates=True)
    assert out["with_posemb"].dtype == torch.bfloat16
    assert torch.isfinite(logits.float()).all()


def test_compiles_without_graph_breaks():
    model = tiny().eval()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.rand(2, 3, 32, 32)
    torch.testing.assert_close(compiled(x), model(x))


def test_attention_weights_are_returned_only_when_asked():
    model = tiny(depth=2)
    out = model(torch.rand(2, 3, 32, 32))
    assert isinstance(out, torch.Tensor)
    _, aux = model(torch.rand(2, 3, 32, 32), return_attention=True)
    assert len(aux["attention"]) == 2 and aux["attention"][0].shape == (2, 2, 17, 17)
    torch.testing.assert_close(aux["attention"][0].sum(-1), torch.ones(2, 2, 17))


def test_hybrid_runs_at_small_resolution():
    model = vitcore.create_model("R50+B/16", img_size=32, num_classes=3, depth=1, width=64, num_heads=2,
                                 mlp_dim=64)
    logits, out = model(torch.rand(1, 3, 32, 32), return_intermediates=True)
    assert logits.shape == (1, 3) and out["stem"].shape == (1, 4, 64)  # 32 / 16 = 2x2 tokens


def test_stochastic_depth_is_identity_at_eval_and_leaves_the_state_dict_alone():
    torch.manual_seed(0)
    plain = vitcore.create_model("Ti/8", num_classes=3, img_size=16, depth=3)
    torch.manual_seed(0)
    deep = vitcore.create_model("Ti/8", num_classes=3, img_size=16, depth=3, drop_path_rate=0.5)
    assert plain.state_dict().keys() == deep.state_dict().keys()
    for (k, a), b in zip(plain.state_dict().items(), deep.state_dict().values()):
        assert torch.equal(a, b), k
    x = torch.randn(2, 3, 16, 16)
    plain.eval(), deep.eval()
    assert torch.equal(plain(x), deep(x))
    assert [b.drop_path1.rate for b in deep.blocks] == pytest.approx([0.0, 0.25, 0.5])  # linear over depth


def test_a_block_branch_is_dropped_at_its_rate_in_training():
    from vitcore.model import drop_path

    torch.manual_seed(0)
    x = torch.ones(20_000, 4, 8)
    out = drop_path(x, 0.3, training=True)
    dropped = (out[:, 0, 0] == 0).float().mean().item()
    assert dropped == pytest.approx(0.3, abs=0.015)
    kept = out[:, 0, 0][out[:, 0, 0] != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / 0.7))
    assert torch.equal(out[:, :1, :1].expand_as(out), out)  # one draw per image, the whole branch
    assert drop_path(x, 0.0, training=True) is x  # rate 0 draws nothing
