"""jobs/study.py: a grid of pre-training cells under one parent run, few-shot scored on task folders,
read as a table; a rerun redoes no cell."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest

from common import tracking
from common.config import parse_args
from tests.conftest import new_home
from training.study import StudyConfig, cell_configs, format_table, run_study
from training.task_folders import SPLITS

REPO = Path(__file__).resolve().parents[2]
RECIPE = "img_size: 32\nbatch_size: 4\nnum_workers: 1\nwarmup_steps: 1\nholdout: 0.1\nlog_every: 1\ndepth: 1\n"


def task_folder(shards, folder, splits=SPLITS):
    """A downstream task folder whose splits are copies of one shard set (real shards, no ingest)."""
    for split in splits:
        shutil.copytree(shards, folder / split)
    return folder


@pytest.mark.parametrize("argv, message", [
    (["--fractions", "0.1,1.5"], "fractions: 1.5 is outside (0, 1]"),
    (["--budget", "steps"], "steps: --budget steps needs --steps N"),
    (["--models", "Ti/16,Q/16"], "models: variant 'Q/16': unknown size 'Q'"),
    (["--shots", "0,5"], "shots: must be positive shot counts"),
    (["--task", "my task=t"], "task: 'my task': NAME may hold letters"),
    ([], "task: score the cells on at least one downstream task"),
    (["--cells-at-once", "-1"], "cells_at_once: must be 0 (as many as the cluster holds) or a count of cells"),
])
def test_bad_grids_are_refused_in_one_line(argv, message, capsys):
    tasks = ["--task", "digits=t"] if argv and argv[0] != "--task" else []
    with pytest.raises(SystemExit) as exc:
        parse_args(StudyConfig, ["--data", "d", *tasks, *argv], prog="study")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_cell_takes_the_recipe_from_config_and_the_tasks_and_shots(tmp_path):
    (tmp_path / "r.yaml").write_text(RECIPE)
    cfg = parse_args(StudyConfig, ["--data", "d", "--task", "digits=t1", "--task", "natural/dtd=t2", "--shots", "5,10",
                                   "--config", str(tmp_path / "r.yaml"), "--models", "mu/8,BiT-mu",
                                   "--fractions", "0.5,1", "--budget", "steps", "--steps", "3"], prog="study")
    cells = cell_configs(cfg)
    assert [(c.variant, c.fraction, c.depth, c.steps) for c in cells] == [
        ("mu/8", 0.5, 1, 3), ("mu/8", 1.0, 1, 3), ("BiT-mu", 0.5, None, 3), ("BiT-mu", 1.0, None, 3)]
    assert len({c.output for c in cells}) == 4
    assert all(c.fewshot_task == ["digits=t1", "natural/dtd=t2"] and c.fewshot_shots == [5, 10] for c in cells)


@pytest.fixture(scope="module")
def two_cells(tiny_shards, tmp_path_factory, mlflow_store, ray_session):
    """A study of two cells on the session's Ray (4 CPUs, one worker a cell: both run at once), run once."""
    tmp_path = tmp_path_factory.mktemp("study")
    (tmp_path / "r.yaml").write_text(RECIPE)
    task = task_folder(tiny_shards, tmp_path / "tiny")
    cfg = StudyConfig(data=str(tiny_shards), task=[f"tiny={task}"], fewshot_data=str(tiny_shards),
                      config=str(tmp_path / "r.yaml"), output=str(tmp_path / "s"), models=["mu/8"],
                      fractions=[0.5, 1.0], shots=[1, 5], budget="steps", steps=2, fewshot_every=1)
    return cfg, run_study(cfg)


def test_a_study_runs_each_cell_once_under_one_parent_and_prints_its_table(two_cells):
    cfg, table = two_cells
    rows = table["rows"]
    assert [(r["model"], r["fraction"], r["steps"]) for r in rows] == [("mu/8", 0.5, 2), ("mu/8", 1.0, 2)]
    assert rows[0]["images"] < rows[1]["images"] and all(r["exaflops"] > 0 and r["best_step"] for r in rows)
    # The task's scores and the --fewshot-data set's are kept apart, per shot count, each with its step
    # (the data set's fit half holds 4 images a class: no 5-shot).
    shots = {k for k in rows[0] if "shot_" in k}
    assert shots == {f"{k}_{m}" for k in ("1shot", "tiny_1shot", "tiny_5shot") for m in ("accuracy", "step")}, shots
    client = mlflow.MlflowClient(tracking.tracking_uri())
    for r in rows:
        run = client.get_run(r["mlflow_run_id"])
        assert table["mlflow_run_id"] in run.data.tags.values(), run.data.tags  # linked to the study's run
    again = run_study(cfg)  # every cell finished: nothing is trained or logged again
    assert [r["mlflow_run_id"] for r in again["rows"]] == [r["mlflow_run_id"] for r in rows]
    assert again["mlflow_run_id"] == table["mlflow_run_id"]
    children = client.search_runs([client.get_experiment_by_name(tracking.experiment_name("pretrain")).experiment_id])
    assert len(children) == 2
    assert not (Path(cfg.output) / "tune").exists()  # Tune's own files are gone with its experiment
    text = format_table(rows)
    assert text.splitlines()[0].split() == ["model", "fraction", "images", "steps", "exaFLOPs", "1shot", "step",
                                            "tiny", "1shot", "step", "tiny", "5shot", "step"]
    assert len(text.splitlines()) == 3


def test_cells_run_side_by_side_as_tune_trials(two_cells):
    """The cluster holds both cells (--cells-at-once 0): their pre-training runs overlap in time."""
    client = mlflow.MlflowClient(tracking.tracking_uri())
    runs = [client.get_run(r["mlflow_run_id"]).info for r in two_cells[1]["rows"]]
    assert max(r.start_time for r in runs) < min(r.end_time for r in runs), [(r.start_time, r.end_time) for r in runs]


def test_the_entrypoint_refuses_a_missing_shard_set_in_one_line(job_main, tmp_path):
    out = job_main("study", "--data", str(tmp_path / "none"), "--task", f"t={tmp_path}", "--models", "mu/8")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"study: error: data: {tmp_path / 'none'} has no manifest.json")
    assert not (tmp_path / "study_output").exists()


def test_the_entrypoint_refuses_a_task_folder_without_a_test_split_in_one_line(job_main, tiny_shards, tmp_path):
    task = task_folder(tiny_shards, tmp_path / "digits", splits=("train800", "val200"))
    out = job_main("study", "--data", str(tiny_shards), "--task", f"digits={task}", "--models", "mu/8")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"study: error: task digits: {task} has no test/ shard set; "
                                                          "prepare it with: python jobs/vtab_prepare.py"), out.stderr
    assert not (tmp_path / "study_output").exists()


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the study's whole session at once: its process and the Ray it started."""
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.getsid(int(entry)) == proc.pid:
                os.kill(int(entry), signal.SIGKILL)
        except OSError:
            pass
    proc.wait(timeout=60)


def _recorded_run(cell: Path) -> str | None:
    try:
        return json.loads((cell / "pretrain_run.json").read_text()).get("mlflow_run_id")
    except (OSError, ValueError):
        return None


def test_a_study_killed_in_its_second_cell_is_finished_by_the_same_command(tiny_shards, tmp_path, job_main,
                                                                          ray_session, monkeypatch):
    """One cell at a time, so that the kill finds one cell finished and the next started."""
    home, out = tmp_path / "home", tmp_path / "s"
    (tmp_path / "r.yaml").write_text(RECIPE)
    task = task_folder(tiny_shards, tmp_path / "tiny")
    args = ["--data", str(tiny_shards), "--task", f"tiny={task}", "--config", str(tmp_path / "r.yaml"),
            "--output", str(out), "--models", "mu/8", "--fractions", "0.5,1", "--shots", "1", "--budget", "steps",
            "--steps", "3", "--fewshot-every", "1", "--cells-at-once", "1"]
    env = dict(os.environ, VITSCALE_HOME=str(new_home(home)), PYTHONPATH=str(REPO))
    for k in ("MLFLOW_TRACKING_URI", "VITSCALE_PARENT_RUN_ID", "RAY_ADDRESS"):
        env.pop(k, None)
    first, second = out / "cells" / "mu8_f0.5", out / "cells" / "mu8_f1"
    with open(tmp_path / "killed.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "jobs/study.py", *args], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)
        try:
            deadline = time.time() + 300
            while time.time() < deadline and proc.poll() is None and not _recorded_run(second):
                time.sleep(0.1)
        finally:
            _kill_session(proc)
    killed = _recorded_run(second)
    assert killed and not (second / "pretrain_summary.json").exists(), (tmp_path / "killed.err").read_text()[-3000:]
    done = json.loads((first / "pretrain_summary.json").read_text())["mlflow_run_id"]

    for k in ("MLFLOW_TRACKING_URI", "VITSCALE_PARENT_RUN_ID", "RAY_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("VITSCALE_HOME", str(home))
    rerun = job_main("study", *args)  # the same command, in this process on the session's Ray
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "cell 1/2 mu/8 at fraction 0.5: finished, skipped" in rerun.stderr
    # The resumed cell's step lines name it.
    assert any(line.startswith("pretrain, cell 2/2 mu/8 at fraction 1") for line in rerun.stderr.splitlines()), \
        rerun.stderr[-3000:]
    rows = json.loads((out / "study_table.json").read_text())["rows"]
    assert [r["mlflow_run_id"] for r in rows] == [done, killed]  # the killed cell resumed into its own run
    client = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    cells = [r for r in runs if r.data.tags.get("vitscale.stage") == "pretrain"]
    assert sorted(r.data.params["fraction"] for r in cells) == ["0.5", "1.0"]  # one run per cell
    assert {r.info.status for r in cells} == {"FINISHED"}
    assert len([r for r in runs if r.data.tags.get("vitscale.stage") == "study"]) == 1
