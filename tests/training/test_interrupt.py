"""jobs/pretrain.py stopped by Ctrl-C, and run again: one line, the newest checkpoint on disk, and the
run in --output resumed (or refused in one line, or replaced with --overwrite)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import new_home

REPO = Path(__file__).resolve().parents[2]


def _env(home: Path) -> dict:
    env = dict(os.environ, VITSCALE_HOME=str(new_home(home)), PYTHONPATH=str(REPO))
    for k in ("MLFLOW_TRACKING_URI", "VITSCALE_PARENT_RUN_ID", "RAY_ADDRESS"):
        env.pop(k, None)
    return env


def _env_here(monkeypatch, home: Path) -> None:
    """:func:`_env` for the runs that are ``main(argv)`` in this process (the ``job_main`` fixture)."""
    monkeypatch.setenv("VITSCALE_HOME", str(new_home(home)))
    for k in ("MLFLOW_TRACKING_URI", "VITSCALE_PARENT_RUN_ID", "RAY_ADDRESS"):
        monkeypatch.delenv(k, raising=False)


def _runs(home: Path) -> list:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def _complete_steps(run_dir: Path) -> dict[str, int]:
    from training.checkpointer import read_record

    return {p.name: rec["step"] for p in run_dir.glob("checkpoint_*") if (rec := read_record(p))}


def _own_lines(stderr: str) -> list[str]:
    """The lines that are not Ray's own prefixed log lines (``(TrainController pid=…)``)."""
    plain = (re.sub(r"\x1b\[[0-9;]*m", "", line) for line in stderr.splitlines())
    return [line for line in plain if line.strip() and not line.startswith("(")]


def test_ctrl_c_keeps_the_newest_checkpoint_and_the_same_command_resumes_from_it(tiny_shards, tmp_path, job_main,
                                                                                   ray_session, monkeypatch):
    home, out = tmp_path / "home", tmp_path / "out"
    job = [sys.executable, "jobs/pretrain.py", "--data", str(tiny_shards), "--output", str(out), "--variant", "Ti/8",
           "--depth", "1", "--img-size", "32", "--batch-size", "4", "--num-workers", "1", "--checkpoint-every", "2",
           "--warmup-steps", "1", "--holdout", "0"]
    proc = subprocess.Popen([*job, "--steps", "100000"], env=_env(home), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and len(_complete_steps_any(out)) < 3:
            time.sleep(0.2)
        assert len(_complete_steps_any(out)) >= 3, "no three checkpoints before the deadline"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Before: exit 1 and not a word.
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    lines = [line for line in _own_lines(stderr) if not line.startswith("pretrain: epoch ")]
    assert len(lines) == 1 and lines[0].startswith("pretrain: interrupted by SIGINT; run 'pretrain-"), stderr
    record = json.loads((out / "pretrain_run.json").read_text())
    run_dir = out / "ray" / record["run_name"]
    steps = _complete_steps(run_dir)
    newest = max(steps.values())
    assert f"kept its checkpoint at step {newest} of 100000" in lines[0]
    assert f"resume with: python jobs/pretrain.py --data {tiny_shards}" in lines[0]
    assert [r.info.status for r in _runs(home)] == ["KILLED"]
    killed = _runs(home)[0].info.run_id

    # The same command, longer by two steps and with no --run-name: it resumes the run in --output,
    # from the newest complete checkpoint on disk, whatever Ray Train's snapshot recorded.
    torn = run_dir / "checkpoint_2000-01-01_00-00-00.000000"
    torn.mkdir()
    (torn / "train_state.pt").write_bytes(b"cut short")
    # The runs after the Ctrl-C are main(argv) in this process, on the session's Ray: the same job, without
    # a fresh interpreter and Ray each.
    _env_here(monkeypatch, home)
    rerun = job_main("pretrain", *job[2:], "--steps", str(newest + 2))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout)
    assert summary["resumed_from_step"] == newest and summary["steps"] == newest + 2
    # The resumed run logs into the run it was killed in, which ends FINISHED: one run, not two.
    assert summary["mlflow_run_id"] == killed and [r.info.status for r in _runs(home)] == ["FINISHED"]
    assert [m.name for m in _logged_models(home, summary["mlflow_run_id"])] == [f"pretrain-Ti8-{tiny_shards.name}"]
    # The finished run submitted again: its summary stands, with no second MLflow run or model.
    again = job_main("pretrain", *job[2:], "--steps", str(newest + 2))
    assert again.returncode == 0 and json.loads(again.stdout) == summary, again.stderr[-3000:]
    assert _own_lines(again.stderr) == [
        f"pretrain: run {record['run_name']!r} finished its {newest + 2} steps already; its model and summary in "
        f"{out} stand (a larger --steps or --epochs trains on, --overwrite starts again)"]
    assert [r.info.status for r in _runs(home)] == ["FINISHED"]
    assert [m.name for m in _logged_models(home, summary["mlflow_run_id"])] == [f"pretrain-Ti8-{tiny_shards.name}"]
    snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    listed = {r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]}
    assert {p.name for p in run_dir.glob("checkpoint_*") if p.is_dir()} == listed  # orphans and the torn folder are gone

    # A changed architecture is refused before Ray starts, in one line, with no MLflow run left behind.
    refused = job_main("pretrain", *job[2:], "--steps", str(newest + 4), "--depth", "2")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert _own_lines(refused.stderr) == [
        f"pretrain: error: run_name {record['run_name']!r}: cannot resume a run trained with a different config "
        "(depth: checkpoint 1, now 2); re-run with the same flags to resume it, pass --overwrite to start it again, "
        "or use another --output"]
    other = job_main("pretrain", *job[2:], "--steps", "4", "--run-name", "another")
    assert other.returncode == 2 and f"holds run {record['run_name']!r}, not 'another'" in other.stderr
    assert len(_runs(home)) == 1

    # --overwrite starts again under a new name; the old run's checkpoints go.
    fresh = job_main("pretrain", *job[2:], "--steps", "2", "--depth", "2", "--overwrite")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert json.loads(fresh.stdout)["resumed_from_step"] == 0
    assert not run_dir.exists()
    assert json.loads((out / "pretrain_run.json").read_text())["run_name"] != record["run_name"]


def _complete_steps_any(out: Path) -> dict[str, int]:
    steps = {}
    for run_dir in (out / "ray").glob("*"):
        steps.update(_complete_steps(run_dir))
    return steps


def _logged_models(home: Path, run_id: str) -> list:
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    try:
        exps = [e.experiment_id for e in mlflow.MlflowClient().search_experiments()]
        return mlflow.search_logged_models(experiment_ids=exps, filter_string=f"source_run_id = '{run_id}'",
                                           output_format="list")
    finally:
        mlflow.set_tracking_uri(None)


def test_ctrl_c_on_finetune_is_one_line_and_a_finished_rerun_logs_no_second_model(tiny_shards, tmp_path,
                                                                                  build_pretrained, job_main,
                                                                                  ray_session, monkeypatch):
    home, out = tmp_path / "home", tmp_path / "out"
    pretrained = build_pretrained(tmp_path / "model.safetensors", img_size=32, representation_size=16)
    job = [sys.executable, "jobs/finetune.py", "--train", str(tiny_shards), "--test", str(tiny_shards),
           "--pretrained", str(pretrained), "--output", str(out), "--lrs", "0.01,0.03,0.1", "--steps", "60",
           "--batch-size", "4", "--warmup-steps", "2", "--max-concurrent", "1", "--val-fraction", "0.25",
           "--flip", "false"]
    proc = subprocess.Popen(job, env=_env(home), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and not list((out / "ray" / "select").glob("*/checkpoint_*")):
            time.sleep(0.2)
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Before: Tune's "Tuner.restore" hint and a TypeError traceback.
    assert proc.returncode == 130, stderr[-3000:]
    lines = [line for line in _own_lines(stderr) if not line.startswith("finetune select:")]
    assert lines == [f"finetune: interrupted by SIGINT; the trials that finished are kept in {out / 'ray'}; "
                     f"resume with: python jobs/finetune.py {' '.join(job[2:])}"], stderr
    assert [r.info.status for r in _runs(home) if r.data.tags.get("vitscale.stage") == "finetune"] == ["KILLED"]

    _env_here(monkeypatch, home)
    for _ in range(2):  # the resume, then a re-run of the finished fine-tune, each main(argv) in this process
        rerun = job_main("finetune", *job[2:])
        assert rerun.returncode == 0, rerun.stderr[-3000:]
    run_id = json.loads(rerun.stdout)["mlflow_run_id"]
    assert [m.name for m in _logged_models(home, run_id)] == [f"finetune-Ti8-{tiny_shards.name}"]
