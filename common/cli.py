"""The shared shape of every entrypoint in ``jobs/``: parse a typed config, run, report errors plainly."""
from __future__ import annotations

import json
import sys
from typing import Any, Callable, Sequence, TypeVar

from common import progress
from common.config import InputError, parse_args

T = TypeVar("T")


def print_json(result: Any) -> None:
    print(json.dumps(result, indent=2, default=str))


def run_job(cls: type[T], runner: Callable[[T], Any], argv: Sequence[str] | None = None, *, prog: str,
            report: Callable[[Any], None] = print_json,
            failures: tuple[type[BaseException], ...] = ()) -> int:
    """Parse ``argv`` into ``cls``, call ``runner``, hand its result to ``report`` (default: JSON on stdout).

    Usage and config errors (including missing or malformed input paths, which the
    libraries raise as subclasses of ``InputError``) exit 2 with one line that
    names the field or file. ``failures`` are a job's own failed checks (counts that do
    not reconcile, say): one line, exit 1. Anything else is a bug and keeps its traceback.

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
    try:
        result = runner(cfg)
    except InputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except failures as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    if result is not None:
        report(result)
    return 0
