import torch

import vitcore
from vitcore.mpp import MaskedPatchPrediction, corrupt_patches, mpp_targets


def test_targets_are_three_bit_mean_colours():
    img = torch.full((1, 3, 16, 16), -1.0)  # black
    img[:, :, :8, 8:] = 1.0  # white patch (top right)
    img[:, 0, 8:, :8] = 1.0  # red patch (bottom left)
    img[:, :, 8:, 8:] = torch.tensor([-1.0, 0.0, 1.0])[:, None, None]  # 0.5 green -> level 4, full blue
    t = mpp_targets(img, 8)
    assert t.tolist() == [[0, 511, 7 * 64, 0 * 64 + 4 * 8 + 7]]
    assert t.max() < 512 and t.min() >= 0


def test_corruption_rates_follow_appendix_b12():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(64, 196, 8, generator=g)
    mask = torch.full((1, 1, 8), 7.0)
    out, corrupted, action = corrupt_patches(tokens, mask, generator=g)
    assert (corrupted.sum(1) == 98).all()  # exactly 50% per image
    n = corrupted.sum().item()
    frac = [(action == a).sum().item() / n for a in (1, 2, 3)]
    assert abs(frac[0] - 0.8) < 0.02 and abs(frac[1] - 0.1) < 0.02 and abs(frac[2] - 0.1) < 0.02
    assert (out[action == 1] == 7.0).all()
    assert torch.equal(out[action == 0], tokens[action == 0]) and torch.equal(out[action == 3], tokens[action == 3])
    replaced = out[action == 2]
    assert not (replaced == tokens[action == 2]).all(dim=-1).any()  # another patch, never itself
    pool = tokens.reshape(-1, 8)
    assert all((pool == r).all(-1).any() for r in replaced[:50])  # taken from the batch


def test_mpp_loss_trains_backbone_and_mask_token():
    torch.manual_seed(0)
    model = MaskedPatchPrediction(vitcore.create_model("mu/8", img_size=32, num_classes=0))
    x = torch.rand(4, 3, 32, 32) * 2 - 1
    logits, targets, corrupted = model(x)
    assert logits.shape == (4, 16, 512) and targets.shape == (4, 16) and corrupted.sum() == 32
    loss = model.loss(x)
    assert abs(loss.item() - torch.log(torch.tensor(512.0)).item()) < 1e-4  # zero head: uniform
    loss.backward()
    assert model.mpp_head.weight.grad.abs().sum() > 0
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.step()
    opt.zero_grad()
    model.loss(x).backward()
    assert model.mask_token.grad.abs().sum() > 0 and model.backbone.patch_embed.proj.weight.grad.abs().sum() > 0
