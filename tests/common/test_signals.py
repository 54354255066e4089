"""SIGTERM stops a pytest run of this suite, whatever a test that ran before left installed.

Sorted after test_progress.py, the first file of the suite's own order that starts Ray in this
process, so the suite also runs :func:`test_a_stage_interrupted_after_ray_started_is_one_line` with
Ray up (test_cli.py runs before it).
"""
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.cli import Interrupted, interrupts, run_job

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("sigterm_probe.py")


@pytest.mark.parametrize("tests", [
    "ray_starts_in_a_fixture or lands_in_a_later_test or no_test_runs_after",  # Ray's handler left behind
    "ray_starts_in_this_test or no_test_runs_after",  # Ray's handler takes the signal itself
])
def test_sigterm_stops_pytest_within_30_s(tests, tmp_path):
    ready = tmp_path / "ready"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RAY_ADDRESS"))}
    env.update(SIGTERM_PROBE_READY=str(ready), PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", str(PROBE), "-k", tests, "-q", "-p", "no:cacheprovider",
                             "--durations=0", f"--basetemp={tmp_path / 'base'}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # to pytest alone, as `kill PID` does
        try:
            out = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            pytest.fail("pytest was still running 30 s after SIGTERM")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out[-3000:]
    assert not (tmp_path / "ran-after").exists(), out[-3000:]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stage_interrupted_after_ray_started_is_one_line(ray_session, signum, capsys):
    def runner(cfg):
        try:
            with interrupts():
                os.kill(os.getpid(), signum)
                time.sleep(5)  # the handler raises before this ends
        except KeyboardInterrupt as exc:
            raise Interrupted(exc.signum, "kept step 4") from None

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert run_job(_Cfg, runner, [], prog="job") == 128 + signum
    assert capsys.readouterr().err == (f"job: interrupted by {signal.Signals(signum).name}; kept step 4; "
                                       "resume with: python jobs/job.py\n")
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@dataclasses.dataclass
class _Cfg:
    """A job with no options."""
