"""common.cli.run_job and common.config.parse_args: what every entrypoint prints and returns."""
import dataclasses
import os
import signal
import time

import pytest

from common.cli import Interrupted, interrupts, run_job
from common.config import InputError, check


@dataclasses.dataclass
class Cfg:
    """A job with a list of rates."""

    lrs: list[float] = dataclasses.field(default_factory=lambda: [0.1], metadata={"help": "rates"})
    name: str = dataclasses.field(default="x", metadata={"help": "a name"})

    def __post_init__(self):
        check(all(lr > 0 for lr in self.lrs), "lrs", f"every rate must be positive, got {self.lrs}")


def test_an_input_error_is_one_line_and_exit_2(capsys):
    def runner(cfg):
        raise InputError(f"name: {cfg.name} not found; pass an existing folder")

    assert run_job(Cfg, runner, ["--name", "/no/such"], prog="job") == 2
    assert capsys.readouterr().err == "job: error: name: /no/such not found; pass an existing folder\n"


def test_a_full_or_read_only_disk_anywhere_in_a_stage_is_one_line_and_exit_2(capsys, tmp_path):
    import errno

    def runner(cfg):
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "part-0"))
        except OSError as exc:  # wrapped, as Ray and Beam hand a worker's error back
            raise RuntimeError("worker failed") from exc

    assert run_job(Cfg, runner, ["--name", "a b"], prog="job") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"job: error: no space left on the disk writing {tmp_path}/out/part-0 (")
    assert err.endswith("MB free there); free some space; then resume with: python jobs/job.py --name 'a b'\n"), err

    def read_only(cfg):
        raise OSError(errno.EROFS, "Read-only file system", "/mnt/ro/x")

    assert run_job(Cfg, read_only, [], prog="job") == 2
    assert capsys.readouterr().err == ("job: error: /mnt/ro/x is on a read-only file system; give a writable folder; "
                                       "then resume with: python jobs/job.py\n")


def test_a_jobs_own_failure_is_one_line_and_exit_1_and_a_bug_keeps_its_traceback(capsys):
    class CountsDoNotReconcile(RuntimeError):
        pass

    def runner(cfg):
        raise CountsDoNotReconcile("3 inputs went missing")

    assert run_job(Cfg, runner, [], prog="job", failures=(CountsDoNotReconcile,)) == 1
    assert capsys.readouterr().err == "job: 3 inputs went missing\n"
    with pytest.raises(CountsDoNotReconcile):
        run_job(Cfg, runner, [], prog="job")


def test_ray_failing_to_start_on_a_busy_machine_is_one_line_and_exit_1(capsys):
    def runner(cfg):  # the exception ray.init raises when its GCS and raylet do not come up in time
        raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.")

    assert run_job(Cfg, runner, ["--name", "n"], prog="job") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("job: error: Ray's local node did not start within its timeout (load ")
    assert err.endswith("run the same command again when the machine is less busy: python jobs/job.py --name n\n")


def test_the_result_goes_to_the_report(capsys):
    seen = []
    assert run_job(Cfg, lambda cfg: {"lrs": cfg.lrs}, ["--lrs", "0.1,0.2"], prog="job", report=seen.append) == 0
    assert seen == [{"lrs": [0.1, 0.2]}]


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--lrs"], "argument --lrs: expected one argument"),
    (["--lrs", "-0.1,0.2"], "lrs: every rate must be positive, got [-0.1, 0.2]"),
    (["--lrs=-0.1"], "lrs: every rate must be positive, got [-0.1]"),
    (["--name", "-x-"], None),  # a value that starts with '-' is a value
])
def test_usage_errors_are_one_line_with_a_pointer_to_help(argv, message, capsys):
    if message is None:
        assert run_job(Cfg, lambda cfg: None, argv, prog="job") == 0
        return
    with pytest.raises(SystemExit) as exc:
        run_job(Cfg, lambda cfg: None, argv, prog="job")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "run job --help for every option" in err


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_inside_interrupts_is_one_line_with_what_was_kept_and_the_resume_command(signum, code, capsys):
    def runner(cfg):
        try:
            with interrupts():
                os.kill(os.getpid(), signum)
                time.sleep(5)  # the handler raises before this ends
        except KeyboardInterrupt as exc:
            raise Interrupted(exc.signum, "kept step 4") from None

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert run_job(Cfg, runner, ["--name", "a b"], prog="job") == code
    assert capsys.readouterr().err == (f"job: interrupted by {signal.Signals(signum).name}; kept step 4; "
                                       "resume with: python jobs/job.py --name 'a b'\n")
    # The handlers are put back: pytest's, or those of a Ray started in this process before.
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_while_the_stage_unwinds_is_ignored(second, capsys):
    unwound = []

    def runner(cfg):
        try:
            with interrupts(before_raise=lambda signum: os.kill(os.getpid(), second)):  # while the reaper runs
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler raises before this ends
        except KeyboardInterrupt as exc:
            os.kill(os.getpid(), second)  # as Ray shuts down, the user presses Ctrl-C again
            time.sleep(0.5)  # a handler still armed would raise in here
            unwound.append("run KILLED, lock released")
            raise Interrupted(exc.signum, "kept step 4") from None

    assert run_job(Cfg, runner, ["--name", "a"], prog="job") == 130
    assert unwound == ["run KILLED, lock released"]
    assert capsys.readouterr().err == ("job: interrupted by SIGINT; kept step 4; "
                                       "resume with: python jobs/job.py --name a\n")
    with pytest.raises(KeyboardInterrupt):  # the next stage is stopped by its first signal again
        with interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)


def test_a_sigterm_to_a_stage_with_no_handler_of_its_own_is_one_line(capsys):
    # It used to end the process at once, silently, with no finally block run.
    def runner(cfg):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    before = signal.getsignal(signal.SIGTERM)
    assert run_job(Cfg, runner, ["--name", "a"], prog="job") == 143
    assert capsys.readouterr().err == "job: interrupted by SIGTERM\n"
    assert signal.getsignal(signal.SIGTERM) == before
