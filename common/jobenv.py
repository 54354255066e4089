"""Where a job's results may go when it runs under ``ray job submit --working-dir``.

Ray runs a submitted entrypoint with its cwd inside a throwaway copy of the uploaded directory
(``.../runtime_resources/working_dir_files/_ray_pkg_<hash>/``). A relative
``--output`` or the default ``./mlruns`` store would land in that copy and vanish with the Ray
session while the job reports success. Every stage that can be submitted resolves its outputs
through :func:`durable_path` and its MLflow store through ``common.tracking``, which refuse such
a location in one line that says what to set.
"""
from __future__ import annotations

import os
from pathlib import Path

from common.config import ConfigError

# The folder Ray unpacks an uploaded working dir into; its children are the per-package copies.
RAY_WORKING_DIR_FILES = "working_dir_files"

RUNTIME_ENV_HINT = (
    "pass an absolute path, or set VITSCALE_HOME (or MLFLOW_TRACKING_URI) to an absolute location with "
    "ray job submit --runtime-env-json '{\"env_vars\": {\"VITSCALE_HOME\": \"/abs/dir\"}}'"
)


def _cwd() -> str:
    # Ray can delete and re-create the unpacked working dir while the job runs (when Ray Train
    # workers set up the same runtime env); the process's cwd then no longer exists.
    try:
        return os.getcwd()
    except FileNotFoundError:
        return os.environ.get("PWD") or _LAUNCH_CWD or "/"


try:
    _LAUNCH_CWD: str | None = os.getcwd()
except FileNotFoundError:
    _LAUNCH_CWD = None


def submitted_copy(cwd: str | os.PathLike | None = None) -> Path | None:
    """The uploaded copy of the working dir this process runs in, or None outside ``ray job submit``."""
    here = Path(cwd or _cwd()).resolve()
    parts = here.parts
    for i in range(len(parts) - 1):
        if parts[i] == RAY_WORKING_DIR_FILES and "runtime_resources" in parts[:i]:
            return Path(*parts[: i + 2])
    return None


def is_url(value: str) -> bool:
    scheme, sep, _ = str(value).partition("://")
    return bool(sep) and scheme not in ("", "file") and "/" not in scheme


def inside_copy(path: str | os.PathLike, cwd: str | os.PathLike | None = None) -> bool:
    copy = submitted_copy(cwd)
    if copy is None:
        return False
    resolved = Path(os.path.normpath(os.path.join(cwd or _cwd(), os.path.expanduser(os.fspath(path)))))
    return resolved == copy or copy in resolved.parents


def vitscale_home_dir() -> Path | None:
    """``$VITSCALE_HOME`` as an absolute path, when set to one outside the uploaded copy."""
    value = os.environ.get("VITSCALE_HOME")
    if not value or not os.path.isabs(os.path.expanduser(value)):
        return None
    path = Path(os.path.expanduser(value))
    return None if inside_copy(path) else path


def durable_path(value: str, field: str) -> str:
    """``value`` as a location that outlives the job: unchanged outside ``ray job submit``; inside
    Ray's uploaded copy, URLs and absolute paths as given and relative paths under ``$VITSCALE_HOME``.

    Raises ConfigError when a relative path would land in Ray's uploaded copy and no
    ``VITSCALE_HOME`` says where to put it instead.
    """
    if is_url(value) or submitted_copy() is None:
        return value
    path = Path(os.path.expanduser(value))
    if not path.is_absolute():
        home = vitscale_home_dir()
        if home is None:
            raise ConfigError(
                f"{field}: {value!r} is relative and this job runs in Ray's uploaded copy of the working dir "
                f"({submitted_copy()}), which is deleted with the Ray session; {RUNTIME_ENV_HINT}"
            )
        path = home / path
    if inside_copy(path):
        raise ConfigError(
            f"{field}: {value!r} is inside Ray's uploaded copy of the working dir, which is deleted with the "
            f"Ray session; {RUNTIME_ENV_HINT}"
        )
    return str(path.resolve())
