import json

import pytest
import torch

import vitcore


def trained_tiny(**kw):
    torch.manual_seed(0)
    model = vitcore.create_model("mu/8", img_size=32, num_classes=5, depth=2, **kw)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


@pytest.mark.parametrize("options", [dict(gelu="erf", representation_size=16),
                                     dict(posemb="2d", classifier="gap"), dict(posemb="relative")])
def test_save_and_load_reproduce_model_and_config(tmp_path, options):
    model = trained_tiny(**options)
    path = tmp_path / "ckpt" / "model.safetensors"
    vitcore.save_checkpoint(model, path)
    loaded = vitcore.load_checkpoint(path).eval()
    assert loaded.config == model.config
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_load_at_higher_resolution_and_new_head(tmp_path):
    model = trained_tiny()
    vitcore.save_checkpoint(model, tmp_path / "m.safetensors")
    with pytest.warns(UserWarning, match="head shape does not match"):
        ft = vitcore.load_checkpoint(tmp_path / "m.safetensors", img_size=48, num_classes=10)
    assert ft.pos_embed.shape == (1, 37, 32) and ft.load_report.resized
    assert torch.count_nonzero(ft.head.weight) == 0
    torch.testing.assert_close(ft.pos_embed[:, 0], model.pos_embed[:, 0])
    assert ft(torch.zeros(1, 3, 48, 48)).shape == (1, 10)


def test_bad_files_are_named(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 5)
    with pytest.raises(ValueError, match="junk.safetensors: not a readable safetensors"):
        vitcore.load_checkpoint(junk)
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        vitcore.load_checkpoint(tmp_path / "nope.safetensors")
    vitcore.save_checkpoint(trained_tiny(), tmp_path / "ok.safetensors")
    with pytest.raises(ValueError, match="unknown override\\(s\\) \\['imgsize'\\]"):
        vitcore.load_checkpoint(tmp_path / "ok.safetensors", imgsize=64)


def _with_config(path, config: dict, tensors: dict) -> None:
    import json

    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": vitcore.checkpoint.FORMAT, "config": json.dumps(config)})


def test_a_config_without_its_tensors_is_refused_before_a_model_is_built(tmp_path):
    import resource
    import time

    config = trained_tiny().config.to_dict()
    big = dict(config, variant="custom", width=2048, depth=12, mlp_dim=8192, num_heads=16)
    path = tmp_path / "empty.safetensors"
    _with_config(path, big, {})
    assert path.stat().st_size < 1000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="empty.safetensors: its config .* needs at least .* holds 0"):
        vitcore.load_checkpoint(path)
    assert time.monotonic() - t0 < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KB: no 3 GB model
    _with_config(path, config, {})
    with pytest.raises(ValueError, match="tensors do not match its config.*missing"):
        vitcore.load_checkpoint(path)


def test_tensors_of_another_shape_or_name_are_refused(tmp_path):
    model = trained_tiny()
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    path = tmp_path / "m.safetensors"
    _with_config(path, dict(config, num_classes=7), sd)  # the head holds 5 classes
    with pytest.raises(ValueError, match="of another shape \\(e.g. head"):
        vitcore.read_checkpoint(path)
    _with_config(path, config, {**sd, "extra.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="1 not in the model \\(e.g. extra.weight\\)"):
        vitcore.read_checkpoint(path)
    _with_config(path, config, sd)
    assert vitcore.read_checkpoint(path)[0] == model.config


def test_bit_resnet_round_trip_keeps_model_and_config(tmp_path):
    torch.manual_seed(0)
    model = vitcore.create_model("BiT-mu", img_size=32, num_classes=5, layers=(2, 1), ws_eps=1e-8)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model.eval()
    path = tmp_path / "bit" / "model.safetensors"
    vitcore.save_checkpoint(model, path)
    loaded = vitcore.load_checkpoint(path).eval()
    assert isinstance(loaded, vitcore.ResNetV2) and loaded.config == model.config
    assert vitcore.checkpoint.check_checkpoint(path) == model.config
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    # Fine-tuning elsewhere: another resolution is only a config change; a new head starts at zero.
    with pytest.warns(UserWarning, match="head shape does not match"):
        ft = vitcore.load_checkpoint(path, img_size=64, num_classes=3)
    assert torch.count_nonzero(ft.head.fc.weight) == 0
    assert torch.equal(ft.stem.conv.weight, model.stem.conv.weight)
    assert ft(torch.zeros(1, 3, 64, 64)).shape == (1, 3)


def test_bit_checkpoint_with_tensors_of_another_model_is_refused(tmp_path):
    model = vitcore.create_model("BiT-mu", img_size=32, num_classes=5)
    config = dict(model.config.to_dict(), layers=[2, 2, 2, 2])
    path = tmp_path / "m.safetensors"
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={"format": vitcore.checkpoint.FORMAT, "architecture": "bit", "config": json.dumps(config)})
    with pytest.raises(ValueError, match="m.safetensors: its tensors do not match its config \\(BiT-mu\\).*missing"):
        vitcore.load_checkpoint(path)
