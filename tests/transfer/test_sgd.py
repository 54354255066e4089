"""transfer.sgd: the fine-tuning loop's Polyak averaging and layer-wise rates, and what a trial's worker prints as it is stopped."""
from pathlib import Path

import pytest
import torch

import vitcore
from training.ema import Polyak


def test_polyak_average_is_what_the_run_evaluates():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    avg = Polyak(model, 0.5)
    values = [1.0, 2.0, 3.0]
    expected = 0.0
    for n, v in enumerate(values):
        with torch.no_grad():
            model.weight.fill_(v)
        avg.update(model)
        d = min(0.5, (1 + n) / (10 + n))
        expected = d * expected + (1 - d) * v
    assert avg.model.weight.flatten().tolist() == pytest.approx([expected, expected])
    assert model.weight[0, 0].item() == 3.0  # the trained model itself is left alone


def _sigterm_in_a_finalizer() -> int:
    """In a Ray worker, what the raylet's SIGTERM does to a trial worker that is shutting down:
    Ray's handler raises SystemExit inside a weakref callback. Then a ValueError in one, which
    must still be reported. Returns the worker's pid."""
    import os
    import signal
    import sys
    import weakref

    class Thing:
        pass

    def on_collect_kill(_):
        os.kill(os.getpid(), signal.SIGTERM)  # Ray's handler runs at the next bytecode, in here

    def on_collect_fail(_):
        raise ValueError("a real fault in a finalizer")

    for callback in (on_collect_kill, on_collect_fail):
        thing = Thing()
        ref = weakref.ref(thing, callback)
        del thing
    del ref
    sys.stderr.flush()
    return os.getpid()


@pytest.mark.parametrize("mute", [False, True], ids=["ray's default", "start_trial"])
def test_a_sigterm_landing_in_a_finalizer_prints_no_traceback_from_a_trial(ray_session, mute):
    from ray._private import worker as ray_worker

    from transfer.sgd import start_trial

    def trial_worker(mute):
        if mute:
            start_trial(1, 0, 0)
        return _sigterm_in_a_finalizer()

    remote = ray_session.remote(max_calls=1)(trial_worker)
    pid = ray_session.get(remote.remote(mute))
    logs = Path(ray_worker._global_node.get_logs_dir_path())
    err = "".join(p.read_text() for p in logs.glob(f"worker-*-{pid}.err"))
    assert "ValueError: a real fault in a finalizer" in err  # other unraisable errors still show
    assert ("SystemExit" in err) is not mute


@pytest.mark.parametrize("variant", ["Ti/8", "BiT-mu"])
def test_layer_decay_gives_each_group_base_times_decay_to_the_layers_from_the_top(variant):
    from training.loop import set_lr
    from transfer.sgd import layer_ids, sgd_param_groups

    model = vitcore.create_model(variant, num_classes=3, img_size=16, **({"depth": 3} if variant == "Ti/8" else {}))
    ids, top = layer_ids(model)
    blocks = 3 if variant == "Ti/8" else sum(model.config.layers)
    assert top == blocks + 1
    if variant == "Ti/8":
        assert ids["cls_token"] == ids["pos_embed"] == ids["patch_embed.proj.weight"] == 0
        assert ids["blocks.0.attn.qkv.weight"] == 1 and ids["blocks.2.mlp.fc2.bias"] == 3
    assert ids["head.weight" if variant == "Ti/8" else "head.fc.weight"] == top
    opt = torch.optim.SGD(sgd_param_groups(model, 0.5), lr=0.1)
    set_lr(opt, 0.2)
    for group in opt.param_groups:
        assert group["lr"] == pytest.approx(0.2 * 0.5 ** (top - group["layer"]))
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    assert [g["layer"] for g in opt.param_groups] == list(range(top + 1))


def test_a_pretrained_model_is_checked_against_the_sha256_a_record_beside_it_holds(tmp_path, build_pretrained):
    import json

    from common.config import ConfigError
    from training.checkpointer import sha256_of, write_record
    from transfer.sgd import pretrained_file

    model = build_pretrained(tmp_path / "model.safetensors", img_size=32, representation_size=16)
    assert pretrained_file(str(tmp_path)) == model  # no record beside it: nothing to check against
    (tmp_path / "pretrain_summary.json").write_text(json.dumps({"sha256": {"model.safetensors": sha256_of(model)}}))
    assert pretrained_file(str(model)) == model
    data = bytearray(model.read_bytes())
    data[-100] ^= 0xFF  # a weight's byte: the header still reads
    model.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=f"pretrained: {model} does not match the sha256 "
                                          f"{tmp_path / 'pretrain_summary.json'} records for it"):
        pretrained_file(str(model))

    folder = tmp_path / "checkpoint_000004"  # a model taken from a checkpoint folder: its record is checkpoint.json
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(bytes(data))
    write_record(folder, ["model.safetensors"], 4)
    assert pretrained_file(str(folder)) == folder / "model.safetensors"
    data[-100] ^= 0xFF
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="checkpoint_000004/checkpoint.json records for it"):
        pretrained_file(str(folder))
