"""The shared shape of every entrypoint in ``jobs/``: parse a typed config, run, report errors plainly."""
from __future__ import annotations

import contextlib
import json
import shlex
import signal
import sys
import threading
from typing import Any, Callable, Iterator, Sequence, TypeVar

from common import progress
from common.config import InputError, parse_args
from common.disk import DiskFull, disk_line

T = TypeVar("T")


class SignalInterrupt(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the main thread while :func:`interrupts` is in force."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Interrupted(Exception):
    """A stage stopped by a signal, saying what it kept (:func:`run_job` prints it in one line with the
    command that resumes, and exits 128 + the signal's number: 130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, signum: int, kept: str) -> None:
        super().__init__(kept)
        self.signum, self.kept = signum, kept


# The first signal of a stage's run, while any :func:`interrupts` is in force (main thread only).
_stopping: dict[str, Any] = {"depth": 0, "signum": None}


@contextlib.contextmanager
def interrupts(before_raise: Callable[[int], None] | None = None) -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`SignalInterrupt` in the main thread for the duration.

    Ray installs its own handlers (``ray.init``: SIGTERM exits 15; Ray Train's ``fit``: SIGINT
    aborts the run and exits 1, silently), so a stage enters this after Ray has started.
    ``before_raise(signum)`` runs first: what the unwinding would otherwise wait on can be stopped there.

    Only the first signal raises: until the outermost of nested contexts exits, later ones are
    ignored, so that a second Ctrl-C (common while Ray shuts down) cannot cut short the unwinding
    that marks the run KILLED, releases the output's lock and reaps the workers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        if _stopping["signum"] is not None:
            return
        _stopping["signum"] = signum
        if before_raise is not None:
            before_raise(signum)
        raise SignalInterrupt(signum)

    before = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM)}
    _stopping["depth"] += 1
    try:
        yield
    finally:
        _stopping["depth"] -= 1
        if not _stopping["depth"]:
            _stopping["signum"] = None
        for s, handler in before.items():
            signal.signal(s, handler)


def print_json(result: Any) -> None:
    print(json.dumps(result, indent=2, default=str))


def _command(prog: str, argv: Sequence[str] | None) -> str:
    """The command that ran this job, to repeat it."""
    return shlex.join(["python", *(sys.argv if argv is None else [f"jobs/{prog}.py", *argv])])


#: What Ray raises when its local node (GCS and raylet) does not come up within its start-up timeout.
RAY_START_TIMEOUT = "timed out during startup"


def _ray_start_timed_out(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if RAY_START_TIMEOUT in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def ray_start_line() -> str:
    """Ray's local node did not start in time: what the machine's load was, and that nothing ran."""
    import os

    load = os.getloadavg()[0]
    return (f"Ray's local node did not start within its timeout (load average {load:.1f} on {os.cpu_count()} cores); "
            "the stage had not started, and its output is as it was")


def run_job(cls: type[T], runner: Callable[[T], Any], argv: Sequence[str] | None = None, *, prog: str,
            report: Callable[[Any], None] = print_json,
            failures: tuple[type[BaseException], ...] = ()) -> int:
    """Parse ``argv`` into ``cls``, call ``runner``, hand its result to ``report`` (default: JSON on stdout).

    Usage and config errors (including missing or malformed input paths, which the
    libraries raise as subclasses of ``InputError``) exit 2 with one line that
    names the field or file. A stage stopped by SIGINT or SIGTERM (:class:`Interrupted`) exits
    128 + the signal with one line: what it kept and the command that resumes. A full or read-only
    disk (:mod:`common.disk`) exits 2 with one line: the path, its free space, what the stage kept
    (:class:`~common.disk.DiskFull`) and the command that resumes. ``failures`` are a job's own failed checks (counts that do
    not reconcile, say): one line, exit 1. So does Ray's local node not starting within its timeout
    on a busy machine. Anything else is a bug and keeps its traceback.

    Every entrypoint also takes ``--verbose`` and ``--progress-every SECONDS``
    (:mod:`common.progress`); without ``--verbose`` the console of a process started from
    the command line is filtered of known noise.
    """
    console: dict[str, Any] = {}
    cfg = parse_args(cls, argv, prog=prog, console=console)
    verbose = console.get("verbose", getattr(cfg, "verbose", None))
    progress.configure(verbose=None if verbose is None else bool(verbose), every=console.get("progress_every"))
    if argv is None:  # a process's own command line; a caller passing argv (a test) keeps its stderr
        progress.quiet_console()
    # A SIGTERM too ends in one line; a stage that knows what it kept says so. The line is printed
    # inside interrupts(), so a second signal cannot cut it off.
    with interrupts():
        try:
            result = runner(cfg)
        except DiskFull as exc:
            kept = f"; {exc.kept}" if exc.kept else ""
            print(f"{prog}: error: {exc.line}{kept}; then resume with: {_command(prog, argv)}", file=sys.stderr)
            return 2
        except InputError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        except Interrupted as exc:
            print(f"{prog}: interrupted by {signal.Signals(exc.signum).name}; {exc.kept}; resume with: "
                  f"{_command(prog, argv)}", file=sys.stderr)
            return 128 + exc.signum
        except KeyboardInterrupt as exc:
            signum = getattr(exc, "signum", signal.SIGINT)
            print(f"{prog}: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
            return 128 + signum
        except failures as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 1
        except Exception as exc:  # a full or read-only disk wherever it struck; anything else is a bug
            line = disk_line(exc)
            if line is not None:
                print(f"{prog}: error: {line}; then resume with: {_command(prog, argv)}", file=sys.stderr)
                return 2
            if not _ray_start_timed_out(exc):
                raise
            print(f"{prog}: error: {ray_start_line()}; run the same command again when the machine is less busy: "
                  f"{_command(prog, argv)}", file=sys.stderr)
            return 1
    if result is not None:
        report(result)
    return 0
