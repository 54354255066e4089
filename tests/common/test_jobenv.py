"""A submitted job's outputs and MLflow store never land in Ray's throwaway copy of the working dir."""
import os

import pytest

from common import jobenv, tracking
from common.config import ConfigError


@pytest.fixture
def in_copy(tmp_path, monkeypatch):
    """cwd inside a directory laid out as Ray unpacks an uploaded working dir."""
    copy = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd"
    (copy / "jobs").mkdir(parents=True)
    monkeypatch.chdir(copy)
    for name in ("VITSCALE_HOME", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    return copy


def test_outside_a_submitted_job_paths_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert jobenv.submitted_copy() is None
    assert jobenv.durable_path("pretrain_output", "output") == "pretrain_output"


def test_relative_output_in_a_copy_is_refused_in_one_line(in_copy):
    assert jobenv.submitted_copy() == in_copy
    with pytest.raises(ConfigError, match=r"^output: 'pretrain_output' is relative and this job runs in Ray's "
                                          r"uploaded copy .* set VITSCALE_HOME") as err:
        jobenv.durable_path("pretrain_output", "output")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="inside Ray's uploaded copy"):
        jobenv.durable_path(str(in_copy / "out"), "output")


def test_vitscale_home_from_the_runtime_env_takes_relative_outputs_and_the_store(in_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("VITSCALE_HOME", str(tmp_path / "home"))
    assert jobenv.durable_path("runs/a", "output") == str(tmp_path / "home" / "runs" / "a")
    assert jobenv.durable_path("/abs/out", "output") == "/abs/out"
    assert jobenv.durable_path("s3://bucket/runs", "output") == "s3://bucket/runs"
    assert tracking.tracking_uri() == f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"


@pytest.mark.parametrize("env, field", [
    ({}, "VITSCALE_HOME"),
    ({"VITSCALE_HOME": "mlruns"}, "VITSCALE_HOME"),
    ({"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"}, "MLFLOW_TRACKING_URI"),
    ({"MLFLOW_TRACKING_URI": "mlruns"}, "MLFLOW_TRACKING_URI"),
])
def test_a_store_inside_the_copy_is_refused(in_copy, monkeypatch, env, field):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=f"^{field}: .*deleted with the Ray session; pass an absolute path"):
        tracking.tracking_uri()


def test_a_server_or_absolute_store_is_accepted(in_copy, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking.tracking_uri() == "http://127.0.0.1:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////srv/mlflow.db")
    assert tracking.tracking_uri() == "sqlite:////srv/mlflow.db"


def test_a_deleted_cwd_still_resolves(in_copy, monkeypatch):
    monkeypatch.setenv("PWD", str(in_copy))
    os.rmdir(in_copy / "jobs")
    os.rmdir(in_copy)
    assert jobenv.submitted_copy() == in_copy


def test_an_absolute_sqlite_store_keeps_its_artifacts_beside_it(in_copy, tmp_path, monkeypatch):
    # Only MLFLOW_TRACKING_URI set, as a user passes it to `ray job submit`: the artifacts go
    # beside the database, not to ./mlruns in Ray's copy (which used to refuse the run).
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    with tracking.start_run("test") as run:
        tracking.log_text("hello", "note.txt")
    assert (tmp_path / "store" / "artifacts").is_dir()
    assert run.info.artifact_uri.startswith((tmp_path / "store" / "artifacts").as_uri())
    assert not (in_copy / "mlruns").exists()
