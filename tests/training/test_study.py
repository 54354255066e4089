"""jobs/study.py: a grid of pre-training cells under one parent run, few-shot scored on task folders,
read as a table; a rerun redoes no cell."""
import shutil

import mlflow
import pytest

from common import tracking
from common.config import parse_args
from training.study import StudyConfig, cell_configs, format_table, run_study
from training.task_folders import SPLITS

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


def test_a_study_runs_each_cell_once_under_one_parent_and_prints_its_table(tiny_shards, tmp_path, mlflow_store,
                                                                           ray_session):
    (tmp_path / "r.yaml").write_text(RECIPE)
    task = task_folder(tiny_shards, tmp_path / "tiny")
    cfg = StudyConfig(data=str(tiny_shards), task=[f"tiny={task}"], fewshot_data=str(tiny_shards),
                      config=str(tmp_path / "r.yaml"), output=str(tmp_path / "s"), models=["mu/8"],
                      fractions=[0.5, 1.0], shots=[1, 5], budget="steps", steps=2, fewshot_every=1)
    table = run_study(cfg)
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
    text = format_table(rows)
    assert text.splitlines()[0].split() == ["model", "fraction", "images", "steps", "exaFLOPs", "1shot", "step",
                                            "tiny", "1shot", "step", "tiny", "5shot", "step"]
    assert len(text.splitlines()) == 3


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

