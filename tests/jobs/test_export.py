"""jobs/export.py: one line on success, and a bad input ends in one line that names it, exit 2."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import vitcore

REPO = Path(__file__).resolve().parents[2]


def export(*args):
    return subprocess.run([sys.executable, str(REPO / "jobs" / "export.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "model.safetensors"
    vitcore.save_checkpoint(vitcore.create_model("mu/8", img_size=16, num_classes=3, depth=1), path)
    return path


def test_export_writes_the_folder_and_says_how_to_load_it(model_file, tmp_path):
    out = export("--model", model_file.parent, "--output", tmp_path / "timm_model")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (f"exported {model_file} to {tmp_path / 'timm_model'} (vit_base_patch16_224 "
                                  f"arguments, 3 classes); load it with timm.create_model('local-dir:"
                                  f"{tmp_path / 'timm_model'}', pretrained=True)")
    assert "label_names are class_0..class_2 (pass --label-map FILE to name them)" in out.stderr
    config = json.loads((tmp_path / "timm_model" / "config.json").read_text())
    assert config["label_names"] == ["class_0", "class_1", "class_2"]


@pytest.mark.parametrize("args, message", [
    (["--model", "{tmp}/none.safetensors", "--output", "{tmp}/out"],
     "model: {tmp}/none.safetensors does not exist; pass the model.safetensors that jobs/pretrain.py"),
    (["--model", "{tmp}/foreign.safetensors", "--output", "{tmp}/out"],
     "model: {tmp}/foreign.safetensors: safetensors file without a vitcore config"),
    (["--model", "{tmp}/text.safetensors", "--output", "{tmp}/out"],
     "model: {tmp}/text.safetensors: not a readable safetensors checkpoint"),
    (["--model", "{tmp}/prelogits.safetensors", "--output", "{tmp}/out"],
     "model: {tmp}/prelogits.safetensors: cannot be exported to timm: its tanh pre-logits layer"),
    (["--model", "{model}", "--output", "{tmp}/full"], "output: {tmp}/full: the folder is not empty"),
    (["--model", "{model}", "--output", "{tmp}/out", "--label-map", "{tmp}/two.txt"],
     "label_map: {tmp}/two.txt: 2 class names for a head of 3 outputs"),
    (["--model", "{model}"], "required field(s) missing: output"),
])
def test_a_bad_input_is_one_line_that_names_it_exit_2(model_file, tmp_path, args, message, job_main):
    save_file({"w": torch.zeros(2)}, tmp_path / "foreign.safetensors")
    (tmp_path / "text.safetensors").write_text("not a model")
    vitcore.save_checkpoint(vitcore.create_model("mu/8", img_size=16, num_classes=3, depth=1, representation_size=8),
                            tmp_path / "prelogits.safetensors")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "two.txt").write_text("a\nb\n")
    out = job_main("export", *[a.format(tmp=tmp_path, model=model_file) for a in args])
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("export: ")]
    assert len(lines) == 1 and message.format(tmp=tmp_path) in lines[0], out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "out").exists()


def test_help_lists_the_flags():
    out = export("--help")
    assert out.returncode == 0, out.stderr
    assert all(flag in out.stdout for flag in ("--config FILE", "--model", "--output", "--label-map"))
