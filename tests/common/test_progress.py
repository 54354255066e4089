"""common.progress: progress lines on a terminal and off one, the console filter, the console flags."""
from __future__ import annotations

import io
import os
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
                   or "resource request" in line for line in err), err
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
