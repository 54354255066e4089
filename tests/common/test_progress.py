"""common.progress: progress lines on a terminal and off one, the console filter, the console flags."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from common import progress
from common.progress import ProgressLine

REPO = Path(__file__).resolve().parents[2]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_progress_is_plain_lines_at_the_interval():
    out = io.StringIO()
    line = ProgressLine("job", stream=out, every=3600)
    assert line.update("1 of 3", force=False)  # the first update always shows
    assert not line.update("2 of 3")  # within the interval
    line.close("3 of 3 done")
    assert out.getvalue() == "job: 1 of 3\njob: 3 of 3 done\n"
    assert "\r" not in out.getvalue()


def test_on_a_terminal_one_line_is_redrawn_in_place():
    out = _Tty()
    line = ProgressLine("job", stream=out, every=3600)
    assert line.tty
    line.update("a long first status")
    line.update("short", force=True)
    line.above("trial 1 finished")
    line.close("done")
    text = out.getvalue()
    assert text.startswith("\rjob: a long first status")
    assert "\rjob: short" + " " * (len("job: a long first status") - len("job: short")) in text
    assert "job: trial 1 finished\n" in text
    assert text.endswith("\rjob: done\n")


def test_an_interval_of_zero_turns_progress_off():
    out = io.StringIO()
    line = ProgressLine("job", stream=out, every=0)
    line.update("x", force=True)
    line.above("y")
    line.close("z")
    assert out.getvalue() == "" and not line.enabled


def test_eta_is_the_work_left_at_the_rate_so_far():
    assert progress.eta(25, 100, 10.0) == 30.0
    assert progress.eta(0, 100, 10.0) is None  # nothing to go on yet
    assert progress.eta(5, None, 10.0) is None  # total unknown
    assert [progress.duration(s) for s in (42.3, 185, 3723)] == ["42s", "3m05s", "1h02m"]


def test_the_ingest_line_counts_units_until_the_items_are_known():
    """Items inside archives are counted as they are read: the line says how many of the units are done."""
    counts = dict.fromkeys(("units", "inputs", "processed", "written", "rejected", "duplicates"), 0)
    now = [0.0]
    line = ProgressLine("prepare", stream=io.StringIO(), every=1e-9, tty=False)
    watch = progress.IngestProgress(line, lambda: counts, 2, None, clock=lambda: now[0])
    assert watch.text() == "starting (0s)"
    counts.update(units=1, inputs=11, processed=4, rejected=1)
    now[0] = 2.0
    assert watch.text() == ("11 inputs seen (1/2 units), 4 processed, 0 written, 1 quarantined, 0 duplicates; "
                            "2.0 img/s, ETA 9s (2s in)")
    assert watch.finish() == counts
    assert line.lines[-1] == "prepare: done in 2s: 11 inputs, 0 written, 1 quarantined, 0 duplicates; 5.5 img/s overall"


def test_without_a_channel_the_ingest_line_shows_the_time_only():
    line = ProgressLine("prepare", stream=io.StringIO(), every=1e-9, tty=False)
    watch = progress.IngestProgress(line, None, 3, 30, clock=lambda: 65.0)
    assert watch.text().startswith("running for 0s (live counts need the staging folder")
    watch.finish()
    assert line.lines == ["prepare: done in 0s"]


def test_importing_progress_does_not_import_ray_and_the_trial_lines_pickle():
    r = subprocess.run([sys.executable, "-c", "import sys, common.progress; print('ray' in sys.modules)"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert r.stdout.strip() == "False", r.stderr
    import pickle

    from ray import tune

    lines = progress.TrialLines("finetune select", ["lr", "model.depth"], "val_accuracy")
    assert isinstance(lines, tune.Callback)
    again = pickle.loads(pickle.dumps(lines))
    assert type(again) is progress.TrialLines and (again.name, again.keys) == (lines.name, lines.keys)


def _trial(config: dict) -> None:
    from ray import tune

    if config["lr"] < 0:
        raise ValueError("a negative learning rate")
    for step in (1, 2):
        tune.report({"step": step, "val_accuracy": config["lr"] * step})


def test_a_sweep_prints_a_line_per_trial_with_its_state_and_metric(ray_session, tmp_path, capsys, monkeypatch):
    from ray import tune

    monkeypatch.setenv("VITSCALE_PROGRESS_EVERY", "1e-9")  # every status update, not one per 15 s

    from transfer.finetune import tune_sweep

    grid = tune_sweep(_trial, {"lr": tune.grid_search([0.25, -1.0])}, name="select", output=tmp_path,
                      resources={"cpu": 1}, metric="val_accuracy")
    assert len(grid) == 2
    out, err = capsys.readouterr()
    ours = [line for line in err.splitlines() if line.startswith("finetune select: ")]
    # The status line: trials per state, then the trial that started or reported.
    assert any(re.fullmatch(r"finetune select: 1 running, 1 pending of 2 \| lr=(0\.25|-1): started", line)
               for line in ours), ours
    assert any(re.fullmatch(r"finetune select: .* of 2 \| lr=0\.25: step 1, val_accuracy 0\.2500", line)
               for line in ours), ours
    assert "finetune select: trial lr=0.25: TERMINATED, step 2, val_accuracy 0.5000" in ours
    assert any(line.startswith("finetune select: trial lr=-1: ERROR") for line in ours), ours
    assert ours[-1] == "finetune select: 1 done, 1 failed of 2"
    # Tune's own experiment output (its experiment box, the TensorBoard hint, trial tables) stays off.
    for text in ("Configuration for experiment", "tensorboard", "Trial status", "View detailed results"):
        assert text.lower() not in (out + err).lower()


def _job(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    """A real entrypoint (run_job) whose job writes noise and a real warning to fd 2 from a child process."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import dataclasses, subprocess, sys
        sys.path.insert(0, {str(REPO)!r})
        from common.cli import run_job
        from common.progress import ProgressLine

        @dataclasses.dataclass
        class Cfg:
            \"\"\"A job.\"\"\"
            n: int = 2

        def run(cfg):
            subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write("
                            "'Failed to import GCSFileSystem; loading of this filesystem will be skipped. x\\\\n'"
                            "'WARNING: disk almost full\\\\n')"])
            print("\\x1b[36m(PlacementGroupCleaner pid=7)\\x1b[0m Traceback (most recent call last):", file=sys.stderr)
            print("\\x1b[36m(PlacementGroupCleaner pid=7)\\x1b[0m   File x", file=sys.stderr)
            print("\\x1b[36m(TrainController pid=8)\\x1b[0m Failed to send resource request for train-1. "
                  "it's safe to ignore this error.", file=sys.stderr)
            print("\\x1b[36m(TrainController pid=8)\\x1b[0m Traceback (most recent call last):", file=sys.stderr)
            print("\\x1b[36m(TrainController pid=8)\\x1b[0m ray.exceptions.GetTimeoutError: Get timed out", file=sys.stderr)
            print("\\x1b[36m(TrainController pid=8)\\x1b[0m Attempting to start training worker group of size 2 "
                  "with the following resources: [{{'CPU': 1}}] * 2", file=sys.stderr)
            print("\\x1b[36m(TrainController pid=8)\\x1b[0m Started training worker group of size 2:", file=sys.stderr)
            line = ProgressLine("job")
            for i in range(cfg.n):
                line.update(f"{{i + 1}}/{{cfg.n}}", force=True)
            line.close("done")
            return {{"n": cfg.n}}

        sys.exit(run_job(Cfg, run, prog="job"))
    """))
    return subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_the_console_hides_known_noise_and_keeps_real_warnings_and_progress(tmp_path):
    r = _job(tmp_path, "--progress-every", "5")
    assert r.returncode == 0, r.stderr
    err = r.stderr.splitlines()
    assert "WARNING: disk almost full" in err
    assert not any("GCSFileSystem" in line or "PlacementGroupCleaner" in line or "GetTimeoutError" in line
                   or "resource request" in line or "Attempting to start" in line for line in err), err
    assert any("Started training worker group" in line for line in err)
    assert [line for line in err if line.startswith("job:")] == ["job: 1/2", "job: 2/2", "job: done"]
    assert '"n": 2' in r.stdout


def test_verbose_shows_everything(tmp_path):
    r = _job(tmp_path, "--verbose")
    assert r.returncode == 0, r.stderr
    assert "GCSFileSystem" in r.stderr and "PlacementGroupCleaner" in r.stderr and "GetTimeoutError" in r.stderr


def test_progress_every_zero_turns_progress_off_and_a_bad_value_is_a_usage_error(tmp_path):
    r = _job(tmp_path, "--progress-every", "0")
    assert r.returncode == 0 and "job:" not in r.stderr
    r = _job(tmp_path, "--progress-every", "-1")
    assert r.returncode == 2
    assert "progress_every: must be 0 (off) or a positive number of seconds, got -1.0" in r.stderr


def test_a_ray_traceback_of_a_full_disk_is_dropped_and_any_other_passes_whole():
    import subprocess
    import sys

    from common.progress import _FILTER, NOISE

    def ray(pid, text):
        return f"\x1b[36m(RayTrainWorker pid={pid})\x1b[0m {text}\n"

    bug = ray(1, "Error in training function:") + ray(1, "Traceback (most recent call last):") + ray(1, '  File "x"') \
        + ray(1, "ValueError: a bug")
    disk = ray(2, "Error in training function:") + ray(2, "Traceback (most recent call last):") \
        + ray(2, "OSError: [Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device")
    fallout = "\x1b[36m(TrainController pid=3)\x1b[0m [FailurePolicy] RAISE\n" \
              "\x1b[36m(TrainController pid=3)\x1b[0m   Source: worker group\n"
    feed = bug + "job: between\n" + disk + fallout + "job: error: no space left on the disk writing /x\n"
    out = subprocess.run([sys.executable, "-S", "-c", _FILTER, *NOISE], input=feed.encode(), capture_output=True,
                         timeout=60).stdout.decode()
    assert out == bug + "job: between\n" + "job: error: no space left on the disk writing /x\n"
