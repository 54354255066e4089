"""VTAB-1k: the registry, the converters, and the whole protocol on three small generated tasks."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import ConfigError
from tests.conftest import new_home
from tests.transfer.conftest import packed_label_map
from transfer.vtab import VtabConfig, aggregate, choose_setting, run_vtab
from transfer.vtab_data import MissingTaskError, resolve_tasks
from transfer.vtab_tasks import GROUPS, TASKS

REPO = Path(__file__).resolve().parents[2]
SIZES = {"train_size": 40, "val_size": 16}


def test_registry_holds_the_19_tasks_with_their_exclusions():
    assert len(TASKS) == 19
    assert [len([t for t in TASKS.values() if t.group == g]) for g in GROUPS] == [7, 4, 8]
    assert {n for n, t in TASKS.items() if not t.flip} == {"dsprites_orientation", "smallnorb_azimuth",
                                                           "dsprites_location"}
    assert {n for n, t in TASKS.items() if not t.crop} == {"clevr_count", "clevr_distance", "dmlab",
                                                           "kitti_distance", "dsprites_location"}
    assert TASKS["sun397"].num_classes == 397 and TASKS["kitti_distance"].num_classes == 4
    assert TASKS["clevr_count"].label_fn({"objects": {"size": [0] * 10}}) == 7
    assert TASKS["dsprites_location"].label_fn({"label_x_position": 31}) == 15
    assert TASKS["dsprites_orientation"].label_fn({"label_orientation": 39}) == 15
    assert TASKS["clevr_distance"].label_fn({"objects": {"pixel_coords": [[0, 0, 9.2], [0, 0, 12.0]]}}) == 3
    kitti = TASKS["kitti_distance"].label_fn
    assert kitti({"objects": {"type": [0, 5], "location": [[0, 0, 25.0], [0, 0, 3.0]]}}) == 2
    assert kitti({"objects": {"type": [5], "location": [[0, 0, 3.0]]}}) == 3  # no vehicle
    assert TASKS["clevr_count"].test_split == "validation"  # CLEVR's test split is TFDS's validation


def test_choose_setting_is_the_best_mean_and_skips_incomplete_settings():
    settings = [{"lr": 0.001, "steps": 5}, {"lr": 0.01, "steps": 5}, {"lr": 0.1, "steps": 5}]
    val = {(0.001, 5): {"a": 0.9, "b": 0.1}, (0.01, 5): {"a": 0.6, "b": 0.6}, (0.1, 5): {"a": 1.0}}
    best, table = choose_setting(val, ["a", "b"], settings)
    assert best == {"lr": 0.01, "steps": 5}  # mean 0.6 beats 0.5; lr 0.1 lacks task b
    assert table[2]["mean_val_accuracy"] is None


def test_aggregates_are_means_of_the_task_numbers():
    tasks = {n: {"group": g, "label_map": {"x": 0, "y": 1}} for n, g in (("a", "natural"), ("b", "natural"),
                                                                        ("c", "structured"))}
    r = aggregate(tasks, {"lr": 0.01, "steps": 5}, {"a": 0.5, "b": 0.7, "c": 0.2}, {"a": 0.4, "b": 0.8, "c": 0.3})
    assert r["groups"] == pytest.approx({"natural": 0.6, "structured": 0.3})
    assert r["mean"] == pytest.approx(0.5)  # over tasks, not over groups


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, build_task_dirs):
    """Three generated tasks (digits, textures, shape counts) through the folders converter."""
    return build_task_dirs(tmp_path_factory.mktemp("vtab"), train=60, test=24, **SIZES)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, build_pretrained):
    return build_pretrained(tmp_path_factory.mktemp("pre") / "model.safetensors", img_size=16, representation_size=192)


def test_folders_converter_writes_three_splits_with_one_label_map(tasks):
    from pipelines.schema import ShardSet

    sets = {s: ShardSet(tasks["count"] / s) for s in ("train800", "val200", "test")}
    assert [len(sets[s]) for s in ("train800", "val200")] == [SIZES["train_size"], SIZES["val_size"]]
    assert len(sets["test"]) == 24
    assert sets["train800"].label_map == sets["val200"].label_map == sets["test"].label_map
    keys = {s: {r["source"] for r in (sets[s][i] for i in range(len(sets[s])))} for s in ("train800", "val200")}
    assert not keys["train800"] & keys["val200"]


def test_folders_converter_repeats_its_keys_and_names_the_original_files(tasks, tmp_path, monkeypatch):
    """The same folders converted again give the same keys in the same order, so a split's
    training order and few-shot draws repeat; each row's source is the image it came from; and
    a conversion run again into its own output replaces it."""
    from pipelines.schema import ShardSet
    from training.data import shard_keys
    from transfer.vtab_data import VtabPrepareConfig, run_vtab_prepare

    raw = tasks["count"].parent / "raw" / "count"
    assert (raw / "train").is_dir()
    monkeypatch.setenv("VITSCALE_HOME", str(new_home(tmp_path / "home")))
    again_cfg = VtabPrepareConfig(source="folders", input=str(raw), output=str(tmp_path / "again"), size=32, **SIZES)
    run_vtab_prepare(again_cfg)
    # Into the same output once more: the same inputs, so the sets are replaced, not refused as
    # "a shard set of other inputs" (the listings once lived in a new temporary folder each run).
    run_vtab_prepare(again_cfg)
    for split in ("train800", "val200", "test"):
        first, again = ShardSet(tasks["count"] / split), ShardSet(tmp_path / "again" / split)
        assert shard_keys(first) == shard_keys(again)
        for i in range(len(again)):
            source = again[i]["source"]
            assert source.startswith(f"file://{raw.resolve()}/") and Path(source[len("file://"):]).is_file()


def test_split_converter_is_deterministic(tasks, tmp_path):
    from pipelines.schema import ShardSet
    from training.data import shard_keys
    from transfer.vtab_data import split_shard_set

    src = tasks["digits"] / "train800"
    for d in ("a", "b"):
        split_shard_set(src, tmp_path / d, train_size=20, val_size=10, seed=3)
    a, b = ({s: shard_keys(ShardSet(tmp_path / d / s)) for s in ("train800", "val200")} for d in ("a", "b"))
    assert a == b and len(a["train800"]) == 20 and len(a["val200"]) == 10
    assert not set(a["train800"]) & set(a["val200"])
    with pytest.raises(ConfigError, match="fewer than --train-size 100"):
        split_shard_set(src, tmp_path / "c", train_size=100, val_size=10)


def test_tfds_converter_needs_tensorflow_datasets(tmp_path):
    try:
        import tensorflow_datasets  # noqa: F401
        pytest.skip("tensorflow-datasets is installed here")
    except ImportError:
        pass
    from transfer.vtab_data import VtabPrepareConfig, run_vtab_prepare

    with pytest.raises(ConfigError, match="needs tensorflow-datasets, which is not installed"):
        run_vtab_prepare(VtabPrepareConfig(source="tfds", task="dtd", tfds_data_dir=str(tmp_path),
                                           output=str(tmp_path / "dtd")))


def test_missing_task_exits_2_naming_the_task_and_the_converter(tmp_path, tasks):
    out = subprocess.run([sys.executable, str(REPO / "jobs" / "vtab.py"), "--data-root", str(tmp_path / "none"),
                          "--output", str(tmp_path / "o")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "task caltech101: " in out.stderr and "does not exist" in out.stderr
    assert "python jobs/vtab_prepare.py --source tfds --task caltech101" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "o").exists()

    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(tasks["digits"] / "train800", partial / "train800")
    with pytest.raises(MissingTaskError, match=r"task mine: .*partial has no val200/ shard set; prepare it with: "
                                               r"python jobs/vtab_prepare.py --source folders"):
        resolve_tasks(None, [f"natural/digits={tasks['digits']}", f"structured/mine={partial}"])
    with pytest.raises(ConfigError, match="GROUP/NAME with GROUP one of natural, specialized, structured"):
        resolve_tasks(None, [f"weird/x={tasks['digits']}"])


def test_an_unlabelled_task_is_refused_before_any_trial(tmp_path, unlabelled_shards):
    # vtab and fewshot both resolve their tasks here, before Ray starts.
    import shutil

    for split in ("train800", "val200", "test"):
        shutil.copytree(unlabelled_shards, tmp_path / "mine" / split)
    with pytest.raises(ConfigError, match=r"task mine: .*train800 is unlabelled \(none of its 16 rows has a label\); "
                                          r"a task needs labelled splits; prepare it with: python jobs/vtab_prepare.py"):
        resolve_tasks(None, [f"structured/mine={tmp_path / 'mine'}"])


@pytest.fixture(scope="module")
def vtab_run(tasks, pretrained, tmp_path_factory, ray_session):
    home = new_home(tmp_path_factory.mktemp("vtab-mlruns"))
    mp = pytest.MonkeyPatch()
    mp.setenv("VITSCALE_HOME", str(home))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.delenv("VITSCALE_PARENT_RUN_ID", raising=False)
    out = tmp_path_factory.mktemp("vtab-out")
    cfg = VtabConfig(task=[f"natural/digits={tasks['digits']}", f"specialized/textures={tasks['textures']}",
                           f"structured/count={tasks['count']}"], no_crop=["count"],
                     pretrained=str(pretrained), output=str(out), img_size=32, lrs=[0.01, 0.1], steps=[3, 6],
                     batch_size=16, microbatch=8, warmup_steps=1)
    try:
        summary = run_vtab(cfg)
        yield {"summary": summary, "out": out, "home": home, "tasks": tasks, "cfg": cfg}
    finally:
        mp.undo()


def test_vtab_results_hold_the_setting_each_task_the_group_means_and_the_mean(vtab_run):
    results = json.loads((vtab_run["out"] / "vtab_results.json").read_text())
    assert set(results) == {"setting", "tasks", "groups", "mean"}
    assert set(results["tasks"]) == {"digits", "textures", "count"}
    for name, r in results["tasks"].items():
        assert set(r) == {"group", "label_map", "val_accuracy", "test_accuracy"}
        assert r["label_map"] == packed_label_map(vtab_run["tasks"][name])  # each task's own class names
    assert {n: r["group"] for n, r in results["tasks"].items()} == {
        "digits": "natural", "textures": "specialized", "count": "structured"}
    for g, m in results["groups"].items():
        assert m == pytest.approx(sum(r["test_accuracy"] for r in results["tasks"].values() if r["group"] == g)
                                  / sum(r["group"] == g for r in results["tasks"].values()))
    assert results["mean"] == pytest.approx(sum(r["test_accuracy"] for r in results["tasks"].values()) / 3)
    assert (vtab_run["out"] / "vtab_results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_final_model_file_names_its_own_tasks_classes(vtab_run):
    from safetensors import safe_open

    found = {}
    for model in (vtab_run["out"] / "ray" / "final").rglob("model.safetensors"):
        trial = next(p for p in model.parents if (p / "params.json").is_file())
        with safe_open(str(model), "pt") as f:
            found[json.loads((trial / "params.json").read_text())["task"]] = json.loads(f.metadata()["labels"])
    assert set(found) == {"digits", "textures", "count"}
    for name, labels in found.items():
        packed = packed_label_map(vtab_run["tasks"][name])
        assert labels == sorted(packed, key=packed.get)


def test_chosen_setting_is_the_best_on_val200_and_never_reads_test(vtab_run):
    results = json.loads((vtab_run["out"] / "vtab_results.json").read_text())
    sweep = json.loads((vtab_run["out"] / "vtab_sweep.json").read_text())["settings"]
    assert len(sweep) == 4
    best = max(sweep, key=lambda r: r["mean_val_accuracy"])
    assert results["setting"] == {"lr": best["lr"], "steps": best["steps"]}
    assert {n: r["val_accuracy"] for n, r in results["tasks"].items()} == best["val_accuracy"]

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{vtab_run['home'] / 'mlflow.db'}")
    parent = client.get_run(vtab_run["summary"]["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    select = [c for c in children if c.data.tags["vitscale.stage"] == "vtab-select"]
    final = [c for c in children if c.data.tags["vitscale.stage"] == "vtab-final"]
    assert len(select) == 12 and len(final) == 3 and len(children) == 15  # a child per trial
    assert all("test_accuracy" not in c.data.metrics for c in select)  # selection never measured test
    assert all(c.info.status == "FINISHED" for c in children)
    for c in final:
        assert float(c.data.params["lr"]) == results["setting"]["lr"]
        assert c.data.metrics["train_rows"] == SIZES["train_size"] + SIZES["val_size"]  # train800val200
        assert c.data.metrics["test_accuracy"] == results["tasks"][c.data.params["task"]]["test_accuracy"]
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"vtab_results.json", "vtab_results.png"} <= artifacts
    assert parent.data.metrics["vtab_mean"] == pytest.approx(results["mean"])


def test_a_resume_on_a_task_split_replaced_since_the_sweep_started_is_refused_in_one_line(vtab_run, tmp_path,
                                                                                          monkeypatch):
    import dataclasses
    import hashlib
    import shutil

    from common.locks import OWNER_FILE
    from transfer.sweep import state_file

    state = json.loads((vtab_run["out"] / state_file("vtab")).read_text())
    for name, folder in vtab_run["tasks"].items():  # the sweep recorded the manifest of every split it read
        for split in ("train800", "val200", "test"):
            manifest = (Path(folder) / split / "manifest.json").read_bytes()
            assert state["data"][f"{name}/{split}"]["manifest_sha256"] == hashlib.sha256(manifest).hexdigest()
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(vtab_run["out"] / OWNER_FILE, out)
    then = "0" * 64  # the sweep started on another digits/train800: the set was replaced while it was stopped
    now = state["data"]["digits/train800"]["manifest_sha256"]
    state["data"]["digits/train800"]["manifest_sha256"] = then
    (out / state_file("vtab")).write_text(json.dumps(state))
    monkeypatch.setenv("VITSCALE_HOME", str(vtab_run["home"]))
    with pytest.raises(ConfigError) as refused:
        run_vtab(dataclasses.replace(vtab_run["cfg"], output=str(out)))
    assert str(refused.value) == (
        f"digits/train800 {state['data']['digits/train800']['url']}: its manifest.json is not the one this vtab "
        f"sweep started on (sha256 {then[:16]}… then, {now[:16]}… now: the set was replaced); pass a new --output "
        "to sweep it afresh, or pass --data-changed-ok to resume on the new data")
    assert sorted(p.name for p in out.iterdir()) == sorted([OWNER_FILE, state_file("vtab")])  # nothing run
