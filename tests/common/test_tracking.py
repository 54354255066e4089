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
