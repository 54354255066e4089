"""A vitcore model exported for timm gives the same logits in timm, or the export refuses in one line.

The timm side runs real timm 1.0.31 in a subprocess. It is installed with ``pip --no-deps`` into a
cache folder outside the project's venv (a full install pulls torchvision, which replaces the
pinned torch), and its model code gets a stand-in for the ``torchvision`` imports it never uses.
timm's ``local-dir:`` loader reads the folder without huggingface_hub, so only timm is installed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import vitcore
from vitcore.checkpoint import CheckpointMismatch
from vitcore.timm_export import (
    ARCHITECTURES,
    DEFAULT_ARCHITECTURE,
    TIMM_CONFIG,
    TIMM_WEIGHTS,
    TimmExportError,
    export_timm,
)

TIMM_VERSION = "1.0.31"
CACHE = Path(os.environ.get("VITSCALE_TEST_CACHE", Path.home() / ".cache" / "vitscale-test")) / f"timm-{TIMM_VERSION}"

TORCHVISION_STUB = '''
"""Stand-in for torchvision: timm imports it at module level; its ViT model code uses none of it."""
import importlib.abc
import importlib.machinery
import sys
import types


class _Absent(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(name, (), {})


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(name, (), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.append(_Finder())
'''

# Arguments: a JSON list of architecture names to look up in timm's registry, then exported folders.
# Loads each folder, runs it on the inputs saved beside it (also with the other GELU) and writes the
# logits there; prints the lookups and what timm resolved for each folder as one JSON line.
TIMM_SIDE = textwrap.dedent('''
    import json, sys
    import timm, torch
    from safetensors.torch import load_file, save_file
    out = {"registered": [timm.is_model(name) for name in json.loads(sys.argv[1])]}
    for folder in sys.argv[2:]:
        model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
        x = load_file(f"{folder}.inputs.safetensors")["x"]
        with torch.no_grad():
            logits = model(x)
            other = timm.create_model(f"local-dir:{folder}", pretrained=True,
                                      act_layer="gelu" if model.blocks[0].mlp.act.__class__.__name__ == "GELUTanh"
                                      else "gelu_tanh").eval()(x)
        save_file({"logits": logits.contiguous(), "other_gelu": other.contiguous()}, f"{folder}.timm.safetensors")
        out[folder] = {"data_config": timm.data.resolve_model_data_config(model),
                       "label_names": model.pretrained_cfg.get("label_names")}
    print(json.dumps(out))
''')

# name: create_model arguments. Ti/8 at 32 px with 4 blocks is the demo's fine-tuned classifier.
CASES = {
    "finetuned_token_learned_tanh": dict(variant="Ti/8", num_classes=10, img_size=32, depth=4),
    "gap_erf": dict(variant="mu/8", num_classes=5, img_size=32, depth=2, classifier="gap", gelu="erf"),
    "sincos_token_not_square": dict(variant="mu/8", num_classes=5, img_size=(32, 24), depth=2, posemb="sincos2d"),
    "sincos_gap": dict(variant="mu/8", num_classes=5, img_size=32, depth=2, posemb="sincos2d", classifier="gap"),
    "axis_2d_token": dict(variant="mu/8", num_classes=5, img_size=32, depth=2, posemb="2d"),
    "axis_2d_gap": dict(variant="mu/8", num_classes=5, img_size=32, depth=2, posemb="2d", classifier="gap"),
    "no_posemb": dict(variant="mu/8", num_classes=5, img_size=32, depth=2, posemb="none"),
    "headless": dict(variant="mu/8", num_classes=0, img_size=32, depth=2),
    "four_channels": dict(variant="mu/8", num_classes=3, img_size=16, depth=1, in_chans=4),
    # int(14 * (61 / 14)) is 60: timm's int(dim * mlp_ratio) needs the next float up.
    "mlp_size_off_a_float_ratio": dict(variant="mu/8", num_classes=3, img_size=16, depth=1, width=14, mlp_dim=61),
}


def trained(variant, seed=0, **kw):
    """A model whose every weight is non-trivial: the zero-initialised head and [class] token of a fresh
    model would make any two implementations agree."""
    torch.manual_seed(seed)
    model = vitcore.create_model(variant, **kw).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model


def _install_timm() -> Path:
    if (CACHE / "timm" / "__init__.py").is_file():
        return CACHE
    staging = CACHE.with_name(f"{CACHE.name}.partial-{uuid.uuid4().hex[:8]}")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--quiet",
           "--target", str(staging), f"timm=={TIMM_VERSION}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        why = "timed out" if done is None else (done.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"timm {TIMM_VERSION} could not be installed from the package index ({why})")
    try:
        staging.rename(CACHE)
    except OSError:  # another session installed it meanwhile
        shutil.rmtree(staging, ignore_errors=True)
    return CACHE


@pytest.fixture(scope="session")
def timm_path(tmp_path_factory) -> str:
    """PYTHONPATH for a subprocess that imports timm, and nothing of it in this process."""
    stub = tmp_path_factory.mktemp("stub")
    (stub / "torchvision").mkdir()
    (stub / "torchvision" / "__init__.py").write_text(TORCHVISION_STUB)
    return os.pathsep.join([str(_install_timm()), str(stub)])


@pytest.fixture(scope="module")
def round_trip(timm_path, tmp_path_factory):
    """Every case exported, loaded with timm.create_model('local-dir:DIR', pretrained=True) and run."""
    root = tmp_path_factory.mktemp("timm_export")
    expected = {}
    for name, kw in CASES.items():
        model = trained(**kw)
        vitcore.save_checkpoint(model, root / f"{name}.safetensors")
        labels = root / f"{name}.labels.txt"
        labels.write_text("".join(f"name {i}\n" for i in range(model.config.num_classes)))
        export_timm(root / f"{name}.safetensors", root / name,
                    label_map=labels if model.config.num_classes else None)
        x = torch.rand(3, model.config.in_chans, *model.config.img_size) * 2 - 1
        save_file({"x": x}, root / f"{name}.inputs.safetensors")
        with torch.no_grad():
            expected[name] = model(x)
    env = {**os.environ, "PYTHONPATH": timm_path}
    architectures = json.dumps(sorted({*ARCHITECTURES.values(), DEFAULT_ARCHITECTURE}))
    done = subprocess.run([sys.executable, "-c", TIMM_SIDE, architectures, *(str(root / n) for n in CASES)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resolved = json.loads(done.stdout.strip().splitlines()[-1])
    cases = {n: dict(expected=expected[n], **load_file(root / f"{n}.timm.safetensors"), **resolved[str(root / n)])
             for n in CASES}
    return {**cases, "registered": resolved["registered"]}


@pytest.mark.parametrize("name", CASES)
def test_timm_gives_the_logits_of_vitcore(round_trip, name):
    r = round_trip[name]
    assert r["logits"].shape == r["expected"].shape
    torch.testing.assert_close(r["logits"], r["expected"], atol=1e-5, rtol=1e-5)


def test_the_gelu_flavour_is_carried_over(round_trip):
    """With the other GELU the logits move beyond the round trip's tolerance, so it would catch a wrong act_layer."""
    for name in ("finetuned_token_learned_tanh", "gap_erf"):
        r = round_trip[name]
        assert not torch.allclose(r["other_gelu"], r["expected"], atol=1e-5, rtol=1e-5), name


def test_timm_resolves_vitscale_eval_input(round_trip):
    """Resize each side to the model's size (bilinear, aspect not kept), no crop, scale to [-1, 1]."""
    assert round_trip["sincos_token_not_square"]["data_config"] == {
        "input_size": [3, 32, 24], "interpolation": "bilinear", "mean": [0.5] * 3, "std": [0.5] * 3,
        "crop_pct": 1.0, "crop_mode": "squash"}
    assert round_trip["four_channels"]["data_config"]["mean"] == [0.5] * 4


def test_class_names_reach_timm(round_trip):
    assert round_trip["finetuned_token_learned_tanh"]["label_names"] == [f"name {i}" for i in range(10)]
    assert round_trip["headless"]["label_names"] is None


def test_every_architecture_the_export_names_is_a_timm_model(round_trip):
    assert round_trip["registered"] and all(round_trip["registered"])


@pytest.mark.parametrize("options, message", [
    (dict(representation_size=16), "tanh pre-logits layer (representation_size=16"),
    (dict(representation_size=16, num_classes=0), "fine-tune the model first"),
    (dict(posemb="relative"), "relative position attention"),
])
def test_what_timm_cannot_represent_is_refused_in_one_line(tmp_path, options, message):
    model = trained(**{"variant": "mu/8", "img_size": 32, "num_classes": 5, "depth": 1, **options})
    vitcore.save_checkpoint(model, tmp_path / "m.safetensors")
    with pytest.raises(TimmExportError, match="cannot be exported to timm") as err:
        export_timm(tmp_path / "m.safetensors", tmp_path / "out")
    assert message in str(err.value) and "\n" not in str(err.value) and err.value.input == "model"
    assert not (tmp_path / "out").exists()


def test_a_hybrid_is_refused(tmp_path):
    model = vitcore.create_model("R26+mu/32", img_size=32, num_classes=2)
    vitcore.save_checkpoint(model, tmp_path / "m.safetensors")
    with pytest.raises(TimmExportError, match="R26\\+mu/32 is a hybrid"):
        export_timm(tmp_path / "m.safetensors", tmp_path / "out")


def test_class_names_come_from_the_label_map_then_the_model_file_then_are_generic(tmp_path):
    model = trained("mu/8", img_size=16, num_classes=3, depth=1)
    vitcore.save_checkpoint(model, tmp_path / "plain.safetensors")
    vitcore.save_checkpoint(model, tmp_path / "named.safetensors", extra_metadata={"labels": '["a", "b", "c"]'})
    (tmp_path / "map.json").write_text('["x", "y", "z"]')
    (tmp_path / "map.txt").write_text("p\nq\nr\n\n")
    (tmp_path / "prepare_map.json").write_text('{"dog": 1, "cat": 0, "eel": 2}')  # as jobs/prepare.py takes it

    def names(src, out, **kw):
        report = export_timm(tmp_path / src, tmp_path / out, **kw)
        return report.label_names, json.loads((tmp_path / out / TIMM_CONFIG).read_text())["label_names"]

    assert names("plain.safetensors", "o1") == ("generic", ["class_0", "class_1", "class_2"])
    assert names("named.safetensors", "o2") == ("the model file", ["a", "b", "c"])
    assert names("named.safetensors", "o3", label_map=tmp_path / "map.json") == (str(tmp_path / "map.json"),
                                                                                  ["x", "y", "z"])
    assert names("plain.safetensors", "o4", label_map=tmp_path / "map.txt")[1] == ["p", "q", "r"]
    assert names("plain.safetensors", "o5", label_map=tmp_path / "prepare_map.json")[1] == ["cat", "dog", "eel"]


@pytest.mark.parametrize("text, message", [
    ("a\n\nb\n", "2 class names for a head of 3 outputs"),
    ('["a", "b", "a"]', "'a' appears twice"),
    ('["a", "", "c"]', "class names must be non-empty strings"),
    ('{"a": 0, "b": 1, "c": 3}', "the ids of a {name: id} map must be 0..2, each once"),
    ('["a", "b"', "not valid JSON"),
])
def test_a_bad_label_map_is_named(tmp_path, text, message):
    vitcore.save_checkpoint(trained("mu/8", img_size=16, num_classes=3, depth=1), tmp_path / "m.safetensors")
    (tmp_path / "labels.txt").write_text(text)
    with pytest.raises(TimmExportError, match="labels.txt: ") as err:
        export_timm(tmp_path / "m.safetensors", tmp_path / "out", label_map=tmp_path / "labels.txt")
    assert message in str(err.value) and err.value.input == "label_map"
    assert not (tmp_path / "out").exists()


def test_the_output_must_be_new_or_empty(tmp_path):
    vitcore.save_checkpoint(trained("mu/8", img_size=16, num_classes=3, depth=1), tmp_path / "m.safetensors")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(TimmExportError, match="full: the folder is not empty"):
        export_timm(tmp_path / "m.safetensors", tmp_path / "full")
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    export_timm(tmp_path / "m.safetensors", tmp_path / "empty")
    assert sorted(os.listdir(tmp_path / "empty")) == [TIMM_CONFIG, TIMM_WEIGHTS]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full", "m.safetensors"]  # no staging left


def test_a_file_that_is_not_a_vitscale_model_is_refused(tmp_path):
    save_file({"w": torch.zeros(2)}, tmp_path / "foreign.safetensors")
    with pytest.raises(CheckpointMismatch, match="foreign.safetensors: safetensors file without a vitcore config"):
        export_timm(tmp_path / "foreign.safetensors", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="missing.safetensors: no such checkpoint"):
        export_timm(tmp_path / "missing.safetensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_bit_resnet_is_refused_in_one_line(tmp_path):
    import vitcore
    from vitcore.checkpoint import save_checkpoint

    save_checkpoint(vitcore.create_model("BiT-mu", num_classes=3, img_size=32), tmp_path / "model.safetensors")
    with pytest.raises(TimmExportError, match="BiT-mu is not a Vision Transformer") as info:
        export_timm(tmp_path / "model.safetensors", tmp_path / "out")
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()
