"""jobs/study.py: a grid of pre-training cells under one parent run, read as a table; a rerun redoes no cell."""
import mlflow
import pytest

from common import tracking
from common.config import parse_args
from training.study import StudyConfig, cell_configs, format_table, run_study

RECIPE = "img_size: 32\nbatch_size: 4\nnum_workers: 1\nwarmup_steps: 1\nholdout: 0.1\nlog_every: 1\ndepth: 1\n"


@pytest.mark.parametrize("argv, message", [
    (["--fractions", "0.1,1.5"], "fractions: 1.5 is outside (0, 1]"),
    (["--budget", "steps"], "steps: --budget steps needs --steps N"),
    (["--models", "Ti/16,Q/16"], "models: variant 'Q/16': unknown size 'Q'"),
])
def test_bad_grids_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(StudyConfig, ["--data", "d", "--fewshot-data", "f", *argv], prog="study")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_bit_cell_drops_the_recipes_vit_size(tmp_path):
    (tmp_path / "r.yaml").write_text(RECIPE)
    cells = cell_configs(StudyConfig(data="d", fewshot_data="f", recipe=str(tmp_path / "r.yaml"),
                                     models=["mu/8", "BiT-mu"], fractions=[0.5, 1.0], budget="steps", steps=3))
    assert [(c.variant, c.fraction, c.depth, c.steps) for c in cells] == [
        ("mu/8", 0.5, 1, 3), ("mu/8", 1.0, 1, 3), ("BiT-mu", 0.5, None, 3), ("BiT-mu", 1.0, None, 3)]
    assert len({c.output for c in cells}) == 4


def test_a_study_runs_each_cell_once_under_one_parent_and_prints_its_table(tiny_shards, tmp_path, mlflow_store,
                                                                           ray_session):
    (tmp_path / "r.yaml").write_text(RECIPE)
    cfg = StudyConfig(data=str(tiny_shards), fewshot_data=str(tiny_shards), recipe=str(tmp_path / "r.yaml"),
                      output=str(tmp_path / "s"), models=["mu/8"], fractions=[0.5, 1.0], budget="steps", steps=2,
                      fewshot_every=1)
    table = run_study(cfg)
    rows = table["rows"]
    assert [(r["model"], r["fraction"], r["steps"]) for r in rows] == [("mu/8", 0.5, 2), ("mu/8", 1.0, 2)]
    assert rows[0]["images"] < rows[1]["images"] and all(r["exaflops"] > 0 and r["best_step"] for r in rows)
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
    assert text.splitlines()[0].split()[:5] == ["model", "fraction", "images", "steps", "exaFLOPs"]
    assert len(text.splitlines()) == 3


def test_the_entrypoint_refuses_a_missing_shard_set_in_one_line(job_main, tmp_path):
    out = job_main("study", "--data", str(tmp_path / "none"), "--fewshot-data", str(tmp_path), "--models", "mu/8")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"study: error: data: {tmp_path / 'none'} has no manifest.json")
    assert not (tmp_path / "study_output").exists()
