"""The one MLflow helper: a real sqlite store, explicit nesting, worker-side logging."""
import os

import mlflow

from common import tracking


def test_runs_nest_and_record_params_and_metrics(mlflow_store):
    with tracking.start_run("parent", params={"a": 1, "nested": {"b": [1, 2]}}) as parent:
        pid = parent.info.run_id
    with tracking.start_run("child", parent_run_id=pid) as child:
        tracking.log_metrics({"loss": 0.5}, step=3)
    trial = tracking.create_child_run(pid, "trial", stage="finetune-trial", params={"lr": 0.01})
    tracking.log_metrics_to(trial, {"val_accuracy": 0.75}, step=10)
    tracking.end_run(trial)

    client = mlflow.MlflowClient(tracking.tracking_uri())
    assert tracking.tracking_uri().startswith("sqlite:///") and (mlflow_store / "mlflow.db").exists()
    p = client.get_run(pid)
    assert p.data.params == {"a": "1", "nested.b": "[1, 2]"}
    assert p.data.tags["vitscale.stage"] == "parent"
    c = client.get_run(child.info.run_id)
    assert c.data.tags["mlflow.parentRunId"] == pid and c.data.metrics["loss"] == 0.5
    t = client.get_run(trial)
    assert t.data.tags["mlflow.parentRunId"] == pid
    assert t.data.metrics["val_accuracy"] == 0.75 and t.info.status == "FINISHED"


def test_failed_stage_is_marked_failed(mlflow_store):
    try:
        with tracking.start_run("boom") as run:
            raise RuntimeError("stage crashed")
    except RuntimeError:
        pass
    assert mlflow.MlflowClient(tracking.tracking_uri()).get_run(run.info.run_id).info.status == "FAILED"


def test_a_run_resumed_on_other_data_names_it_and_keeps_the_manifest_it_trained_on(mlflow_store):
    # A resume with --data-changed-ok went on under tags naming the manifest it no longer read.
    sets = [{"name": "s", "url": "/d/s", "manifest_sha256": c * 64, "role": "training"} for c in "abc"]
    with tracking.start_run("pretrain", tags=tracking.run_tags(data=sets[:1])) as run:
        tracking.log_shard_inputs(sets[:1])
    run_id = run.info.run_id
    assert not tracking.refresh_inputs(run_id, tracking.run_tags(data=sets[:1]), sets[:1])  # the same data
    for record in sets[1:]:
        assert tracking.refresh_inputs(run_id, tracking.run_tags(data=[record]), [record])
    done = mlflow.MlflowClient(tracking.tracking_uri()).get_run(run_id)
    assert done.data.tags[tracking.TAG_INPUT_MANIFEST] == "c" * 64
    assert done.data.tags[tracking.TAG_EARLIER_INPUT] == f"{'a' * 64},{'b' * 64}"
    assert sorted(d.dataset.digest for d in done.inputs.dataset_inputs) == ["a" * 36, "b" * 36, "c" * 36]


def test_stray_mlflow_run_id_does_not_reparent(mlflow_store, monkeypatch):
    with tracking.start_run("other") as other:
        pass
    monkeypatch.setenv("MLFLOW_RUN_ID", other.info.run_id)
    with tracking.start_run("fresh") as fresh:
        pass
    assert fresh.info.run_id != other.info.run_id


def test_a_later_vitscale_home_is_honoured_in_the_same_process(mlflow_store, monkeypatch, tmp_path):
    # mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI; the helper must not then read its own echo.
    with tracking.start_run("first") as first:
        pass
    assert "MLFLOW_TRACKING_URI" not in os.environ
    monkeypatch.setenv("VITSCALE_HOME", str(tmp_path / "elsewhere"))
    with tracking.start_run("second") as second:
        pass
    assert (tmp_path / "elsewhere" / "mlflow.db").exists()
    assert mlflow.MlflowClient(tracking.tracking_uri()).get_run(second.info.run_id).info.run_name
    assert [r.info.run_id for r in mlflow.MlflowClient(tracking.default_tracking_uri()).search_runs(
        [e.experiment_id for e in mlflow.MlflowClient(tracking.default_tracking_uri()).search_experiments()])] == [
        second.info.run_id]
    assert first.info.run_id != second.info.run_id


def test_params_and_tags_that_are_not_utf8_are_logged_as_text(mlflow_store):
    # A path with Latin-1 bytes (an --output folder, say) used to fail the run in MLflow's store.
    path = os.fsdecode(b"/data/caf\xe9")
    with tracking.start_run("prepare", params={"output": path, "input": [path]}, tags={"src": path}) as run:
        pass
    r = mlflow.MlflowClient(tracking.tracking_uri()).get_run(run.info.run_id)
    assert r.data.params["output"] == "/data/caf\\xe9" and r.data.tags["src"] == "/data/caf\\xe9"


def test_experiments_are_marked_as_model_training(mlflow_store):
    # Without the tag MLflow 3.17's UI opens the experiment on its GenAI overview, not the runs.
    with tracking.start_run("prepare", experiment="fresh"):
        pass
    client = mlflow.MlflowClient(tracking.tracking_uri())
    assert client.get_experiment_by_name("fresh").tags["mlflow.experimentKind"] == "custom_model_development"

    # An experiment made before the tag existed (or by plain mlflow) is marked when a stage uses it.
    old = client.create_experiment("old")
    assert "mlflow.experimentKind" not in client.get_experiment(old).tags
    with tracking.start_run("dedup", experiment="old") as run:
        pass
    assert run.info.experiment_id == old
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"

    # A kind someone set on purpose stays.
    genai = client.create_experiment("agents", tags={"mlflow.experimentKind": "genai_development"})
    with tracking.start_run("x", experiment="agents"):
        pass
    assert client.get_experiment(genai).tags["mlflow.experimentKind"] == "genai_development"


def test_ui_url_opens_the_runs_table():
    assert tracking.ui_url("7") == "http://127.0.0.1:5000/#/experiments/7?workflowType=machine_learning"
    assert tracking.ui_url("7", "http://h:1/").startswith("http://h:1/#/experiments/7?")


def test_each_stage_has_its_experiment_and_children_stay_with_their_parent(mlflow_store, monkeypatch):
    client = mlflow.MlflowClient(tracking.tracking_uri())
    with tracking.start_run("fewshot") as stage:
        pass
    with tracking.start_run("fewshot-task", parent_run_id=stage.info.run_id) as task:
        pass
    exp = client.get_experiment(stage.info.experiment_id)
    assert exp.name == "vitscale-fewshot" == tracking.experiment_name("fewshot")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    t = client.get_run(task.info.run_id)
    assert t.info.experiment_id == stage.info.experiment_id and t.data.tags["mlflow.parentRunId"] == stage.info.run_id

    monkeypatch.setenv("VITSCALE_EXPERIMENT_PREFIX", "team")
    assert tracking.experiment_name("dedup-calibration") == "team-dedup-calibration"


def test_a_parent_in_another_experiment_is_a_tag_not_a_nesting(mlflow_store, monkeypatch):
    # The demo's grouping run lives in vitscale-demo; its stages in their own experiments.
    client = mlflow.MlflowClient(tracking.tracking_uri())
    with tracking.start_run("demo") as demo:
        pass
    monkeypatch.setenv("VITSCALE_PARENT_RUN_ID", demo.info.run_id)
    with tracking.start_run("prepare") as prep:
        pass
    trial = tracking.create_child_run(prep.info.run_id, "child", stage="prepare-part")
    r = client.get_run(prep.info.run_id)
    assert client.get_experiment(r.info.experiment_id).name == "vitscale-prepare"
    assert "mlflow.parentRunId" not in r.data.tags
    assert r.data.tags["vitscale.parent_run_id"] == r.data.tags["vitscale.demo_run_id"] == demo.info.run_id
    # Children of a demo stage carry the demo's id too, so one tag search finds the demo's runs.
    assert client.get_run(trial).data.tags["vitscale.demo_run_id"] == demo.info.run_id


def test_run_tags_carry_lineage_transitively():
    corpus = {"manifest_sha256": "a" * 64, "prepare_run_id": "p1", "dedup_run_ids": ["d1"],
              "dedup_state": "ingest vs t: 3 removed"}
    train = {"manifest_sha256": "b" * 64, "prepare_run_id": "p2", "dedup_run_ids": [], "dedup_state": "none"}
    pre = tracking.run_tags({"lr": 0.1}, data=[corpus])
    assert pre["vitscale.input_manifest_sha256"] == "a" * 64 and pre["vitscale.dedup_state"] == "ingest vs t: 3 removed"
    assert pre["vitscale.lineage.prepare"] == "p1" and pre["vitscale.lineage.dedup"] == "d1"
    assert pre["vitscale.config_hash"] == tracking.config_hash({"lr": 0.1}) and len(pre["vitscale.config_hash"]) == 16
    assert pre["vitscale.git_commit"]
    model = {"run_id": "r-pre", "stage": "pretrain", "tags": pre}
    fine = tracking.run_tags({"lr": 0.01}, data=[train, corpus], main=[train], models=[model])
    assert fine["vitscale.lineage.prepare"] == "p1,p2"  # the pre-training's data first, then its own
    assert fine["vitscale.lineage.dedup"] == "d1" and fine["vitscale.lineage.pretrain"] == "r-pre"
    assert fine["vitscale.input_manifest_sha256"] == "b" * 64
    assert fine["vitscale.dedup_state"] == "none | pre-training data: ingest vs t: 3 removed"


def test_a_shard_sets_content_digest_ignores_which_run_wrote_it_and_sees_every_shard_label_and_removal(tmp_path):
    import json

    from pipelines.schema import shard_set_record

    def record(run_id: str, sha: str = "1" * 64, label_map: dict | None = None, removed: tuple = ()):
        folder = tmp_path / run_id
        folder.mkdir(exist_ok=True)
        (folder / "manifest.json").write_text(json.dumps({
            "schema_version": 1, "num_rows": 3, "mlflow_run_id": run_id, "config": {"output": str(folder)},
            "shards": [{"path": "shard-00000.arrow", "rows": 3, "bytes": 10, "sha256": sha}],
            "label_map": label_map or {"cat": 0, "dog": 1}}))
        if removed:
            (folder / "removed.jsonl").write_text("".join(json.dumps({"key": k}) + "\n" for k in removed))
        return shard_set_record(folder)

    first, again = record("prep-1"), record("prep-2")
    assert first["manifest_sha256"] != again["manifest_sha256"]
    assert first["content_sha256"] == again["content_sha256"]
    assert tracking.run_tags({}, data=[again])["vitscale.input_data_sha256"] == first["content_sha256"]
    assert record("prep-3", sha="2" * 64)["content_sha256"] != first["content_sha256"]
    assert record("prep-4", label_map={"cat": 1, "dog": 0})["content_sha256"] != first["content_sha256"]
    assert record("prep-5", removed=("k1",))["content_sha256"] != first["content_sha256"]


def test_lineage_beside_a_model_and_shard_sets_as_dataset_inputs(mlflow_store, tmp_path):
    shards = tmp_path / "corpus"
    shards.mkdir()
    (shards / "manifest.json").write_text('{"schema_version": 1, "shards": [], "num_rows": 0, '
                                          '"mlflow_run_id": "prep-1", "counts": {"duplicates": {"corpus": 0}}}')
    from pipelines.schema import shard_set_record

    record = shard_set_record(shards)
    assert record["prepare_run_id"] == "prep-1" and record["dedup_state"] == "none" and record["name"] == "corpus"
    with tracking.start_run("pretrain", tags=tracking.run_tags({}, data=[record])) as run:
        tracking.log_shard_inputs([record])
    (tmp_path / "model.safetensors").write_bytes(b"")
    tracking.write_lineage(tmp_path, run, "pretrain")
    lineage = tracking.read_lineage(tmp_path / "model.safetensors")
    assert lineage["run_id"] == run.info.run_id and lineage["tags"]["vitscale.lineage.prepare"] == "prep-1"
    assert tracking.read_lineage(tmp_path / "nowhere" / "model.safetensors") == {}

    inputs = mlflow.MlflowClient(tracking.tracking_uri()).get_run(run.info.run_id).inputs.dataset_inputs
    (d,) = inputs
    assert d.dataset.name == "corpus" and d.dataset.digest == record["manifest_sha256"][:36]
    assert str(shards) in d.dataset.source
    assert {t.key: t.value for t in d.tags}["mlflow.data.context"] == "training"


def test_a_stage_run_inside_an_active_driver_run_is_not_nested_across_experiments(mlflow_store):
    client = mlflow.MlflowClient(tracking.tracking_uri())
    with tracking.start_run("demo") as demo:
        with tracking.start_run("dedup", parent_run_id=demo.info.run_id) as stage:
            assert mlflow.active_run().info.run_id == stage.info.run_id
        assert mlflow.active_run().info.run_id == demo.info.run_id
    r = client.get_run(stage.info.run_id)
    assert "mlflow.parentRunId" not in r.data.tags and r.data.tags["vitscale.demo_run_id"] == demo.info.run_id
    assert r.info.status == "FINISHED" and r.data.tags.get("mlflow.source.name")


def test_one_recipe_run_into_two_folders_has_one_hash():
    from training.pretrain import PretrainConfig

    here = PretrainConfig(data="/a/shards", output="/a/out", run_name="one", storage_path="/a/ray")
    there = PretrainConfig(data="/b/shards", output="/b/out", run_name="two", ray_address="auto", microbatch=8)
    assert tracking.config_hash(here) == tracking.config_hash(there)
    assert tracking.config_hash(here) != tracking.config_hash(PretrainConfig(data="/a/shards", lr=0.5))
    tags = tracking.run_tags(here)
    assert {"output", "storage_path", "run_name", "data"} <= set(tags[tracking.TAG_NOT_RECIPE].split(","))
    assert "lr" not in tags[tracking.TAG_NOT_RECIPE].split(",")


_START_TOGETHER = """
import sys, time
from common import tracking
import mlflow.store.tracking.sqlalchemy_store  # loaded before the start line: all reach the store at once
start = float(sys.argv[1])
while time.time() < start:
    time.sleep(0.001)
with tracking.start_run("prepare", params={"i": sys.argv[2]}):
    tracking.log_metrics({"x": 1.0})
"""


def test_jobs_started_together_on_a_new_store_all_succeed(tmp_path):
    # Each process would otherwise run MLflow's migrations on the one new sqlite file.
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    home = tmp_path / "fresh_home"
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID")}
    env.update(VITSCALE_HOME=str(home), PYTHONPATH=str(REPO))
    start = time.time() + 8
    procs = [subprocess.Popen([sys.executable, "-c", _START_TOGETHER, str(start), str(i)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(4)]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(o[-600:] for o in outputs)
    client = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(tracking.experiment_name("prepare")).experiment_id])
    assert len(runs) == 4


def test_naming_the_store_does_not_create_it(tmp_path, monkeypatch):
    # The report tells a user with no store to run a stage first; asking for the URI must not make one.
    monkeypatch.setenv("VITSCALE_HOME", str(tmp_path / "none_yet"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.tracking_uri().endswith("/none_yet/mlflow.db")
    assert not (tmp_path / "none_yet").exists()
