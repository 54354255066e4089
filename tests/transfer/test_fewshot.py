"""Few-shot linear evaluation over task folders: separable features, the whole flow, MLflow, the console lines."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.transfer.conftest import packed_label_map
from transfer import fewshot
from transfer.fewshot import FewshotConfig, evaluate_task, run_fewshot

REPO = Path(__file__).resolve().parents[2]


def test_linearly_separable_features_reach_1():
    rng = np.random.default_rng(0)
    centres = rng.normal(0, 10, (4, 16))
    y_train, y_test = np.repeat(np.arange(4), 30), np.repeat(np.arange(4), 20)
    x_train = centres[y_train] + rng.normal(0, 0.5, (len(y_train), 16))
    x_test = centres[y_test] + rng.normal(0, 0.5, (len(y_test), 16))
    out = evaluate_task(x_train, y_train, x_test, y_test, 4, [1, 5, 10, 25], [0, 1, 2], 2.0 ** 10)
    for k in ("1", "5", "10", "25"):
        assert out[k]["mean"] == 1.0 and out[k]["std"] == 0.0 and len(out[k]["per_draw"]) == 3
    skipped = evaluate_task(x_train, y_train, x_test, y_test, 4, [50], [0], 1.0)
    assert "fewer than 50" in skipped["50"]["skipped"]


@pytest.fixture(scope="module")
def task_dirs(tmp_path_factory, build_task_dirs):
    return build_task_dirs(tmp_path_factory.mktemp("fewshot"), ["textures", "count"], train=60, test=20,
                          train_size=40, val_size=12)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, build_pretrained):
    return build_pretrained(tmp_path_factory.mktemp("pre") / "model.safetensors", img_size=32, representation_size=64)


def test_fewshot_flow_computes_features_once_per_task(task_dirs, pretrained, tmp_path, mlflow_store, monkeypatch):
    calls = []
    real = fewshot.features
    monkeypatch.setattr(fewshot, "features", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    cfg = FewshotConfig(pretrained=str(pretrained), task=[f"specialized/textures={task_dirs['textures']}",
                                                          f"structured/count={task_dirs['count']}"],
                        output=str(tmp_path / "o"), shots=[1, 5, 10], draws=3)
    summary = run_fewshot(cfg)
    assert len(calls) == 4  # pool and test of each task, once; reused by every shot count and draw
    results = json.loads((tmp_path / "o" / "fewshot_results.json").read_text())
    for name in ("textures", "count"):
        assert results["tasks"][name]["label_map"] == packed_label_map(task_dirs[name])  # each task's own names
        shots = results["tasks"][name]["shots"]
        assert set(shots) == {"1", "5", "10"}
        for r in shots.values():
            assert len(r["per_draw"]) == 3 and r["mean"] == pytest.approx(np.mean(r["per_draw"]))
            assert r["std"] == pytest.approx(np.std(r["per_draw"]))
    for k in ("1", "10"):
        assert results["mean"][k] == pytest.approx(np.mean([results["tasks"][n]["shots"][k]["mean"]
                                                            for n in ("textures", "count")]))
        assert results["groups"]["structured"][k] == results["tasks"]["count"]["shots"][k]["mean"]

    import mlflow

    from common import tracking

    client = mlflow.MlflowClient(tracking.tracking_uri())
    parent = client.get_run(summary["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(c.data.params["task"] for c in children) == ["count", "textures"]
    assert "fewshot_results.json" in {a.path for a in client.list_artifacts(parent.info.run_id)}


def test_fewshot_entrypoint_names_a_missing_task(tmp_path, pretrained):
    out = subprocess.run([sys.executable, str(REPO / "jobs" / "fewshot.py"), "--pretrained", str(pretrained),
                          "--task", f"dtd={tmp_path / 'nope'}"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 2
    assert "task dtd: " in out.stderr and "jobs/vtab_prepare.py --source tfds --task dtd" in out.stderr


def test_fewshot_prints_a_line_per_task_with_its_accuracies(tmp_path_factory, build_task_dirs, build_pretrained,
                                                           tmp_path, mlflow_store, capsys):
    tasks = build_task_dirs(tmp_path_factory.mktemp("fewshot"), ["count"], train=40, test=10, train_size=24,
                            val_size=8)
    pretrained = build_pretrained(tmp_path / "model.safetensors", img_size=32, representation_size=16)
    capsys.readouterr()
    summary = run_fewshot(FewshotConfig(pretrained=str(pretrained), task=[f"structured/count={tasks['count']}"],
                                        output=str(tmp_path / "o"), shots=[1, 2], draws=1))
    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fewshot: ")]
    assert ours[0] == "fewshot: task count (1/1): RUNNING, extracting features"
    shots = summary["tasks"]["count"]["shots"]
    assert re.fullmatch(rf"fewshot: task count \(1/1\): done in \S+, 1-shot accuracy {shots['1']['mean']:.3f}, "
                        rf"2-shot accuracy {shots['2']['mean']:.3f}", ours[-1]), ours
