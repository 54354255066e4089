"""The shared shape of every entrypoint in ``jobs/``: parse a typed config, run, report errors plainly."""
from __future__ import annotations

import json
import sys
from typing import Any, Callable, Sequence, TypeVar

from common.config import InputError, parse_args

T = TypeVar("T")


def run_job(cls: type[T], runner: Callable[[T], Any], argv: Sequence[str] | None = None, *, prog: str) -> int:
    """Parse ``argv`` into ``cls``, call ``runner``, print its JSON summary.

    Usage and config errors (including missing or malformed input paths, which the
    libraries raise as subclasses of ``InputError``) exit 2 with one line that
    names the field or file; anything else is a real failure and keeps its traceback.
    """
    cfg = parse_args(cls, argv, prog=prog)
    try:
        result = runner(cfg)
    except InputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if result is not None:
        print(json.dumps(result, indent=2, default=str))
    return 0
