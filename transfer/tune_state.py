"""A Tune sweep's saved state, kept whole through a kill and consistent before a resume.

Tune copies its experiment state (the trials) and its grid's state (how far the grid has been
generated) into the sweep's folder after every event. :func:`storage` makes each copied file
appear whole or not at all. :func:`prepare_resume` then sets the grid's position from the trials
the experiment state records: a kill between the two copies otherwise ran a finished trial
again, or waited on it forever. A state that still cannot be read is moved aside, and the sweep
starts again in one line.
"""
from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import time
from pathlib import Path

import pyarrow
import pyarrow.fs

from common import progress
from common.fs import TMP_MARKER, atomic_write, tmp_name

EXPERIMENT_STATE = "experiment_state-*.json"
GRID_STATE = "basic-variant-state-*.json"


class _RenamedWhenClosed(io.FileIO):
    """A file written under a temporary name beside ``path`` that becomes ``path`` when closed.

    Arrow closes it when a copy has written it all. A copy that fails partway drops it unclosed,
    and the collector's finaliser then deletes it: the half-written file never replaces ``path``.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        super().__init__(tmp_name(path), "wb")

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        os.replace(self.name, self._path)

    def __del__(self) -> None:
        if self.closed:
            return
        super().close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.name)


class _WholeFiles(pyarrow.fs.FSSpecHandler):
    def open_output_stream(self, path, metadata):
        return pyarrow.PythonFile(_RenamedWhenClosed(path), mode="w")


def storage() -> pyarrow.fs.FileSystem:
    """The local disk as Tune's ``storage_filesystem``: a file appears only once it is whole."""
    import fsspec

    return pyarrow.fs.PyFileSystem(_WholeFiles(fsspec.filesystem("file")))


def _read_state(experiment: str, grid: str | None) -> tuple[list[dict], object]:
    """The trials the experiment state records, and the grid's saved state (None without one).

    The experiment state is read as plain JSON: what Tune could only pickle into it stays an
    undecoded value, as only the trials' ids and statuses are read. The grid's state is a pickle
    by Tune's own design, which Tune's restore loads as well.
    """
    import ray.cloudpickle as cloudpickle

    with open(experiment, "rb") as f:
        trials = [_trial_json(t) for t in json.load(f)["trial_data"]]
    if grid is None:
        return trials, None
    with open(grid, "rb") as f:
        return trials, cloudpickle.load(f)


def _newest(folder: Path, pattern: str) -> str | None:
    paths = glob.glob(str(folder / pattern))
    return max(paths) if paths else None  # what Tune loads: the names end in the session's start time


def prepare_resume(folder: Path, prog: str) -> bool:
    """Make the sweep saved in ``folder`` safe for ``Tuner.restore``; False if it must start again.

    Leftover temporary files are removed. An unreadable state moves the folder aside (its trials
    run again) and returns False, after one line on the console. A grid whose saved position
    differs from the trials the experiment state records is set to that number of trials; one
    laid out in a way this code does not know is left as Tune saved it, after one line.
    """
    import ray.cloudpickle as cloudpickle

    for leftover in folder.glob(f"*{TMP_MARKER}*"):
        leftover.unlink(missing_ok=True)
    experiment, grid = _newest(folder, EXPERIMENT_STATE), _newest(folder, GRID_STATE)
    if experiment is None:
        return True  # nothing of ours to check: Tune says what it makes of the folder
    out = progress.console()[0]
    try:
        trials, state = _read_state(experiment, grid)
    except Exception as exc:  # cut short, or not Tune's: anything that stops Tune restoring it
        aside = folder.with_name(f"{folder.name}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(folder, aside)
        print(f"{prog} {folder.name}: the sweep's saved state in {folder} cannot be read "
              f"({type(exc).__name__}); moved it to {aside.name} and running every trial again",
              file=out, flush=True)
        return False
    try:
        changed = bool(state) and _set_grid_position(state, trials)
    except (ImportError, AttributeError, TypeError, KeyError, ValueError) as exc:  # another Ray's layout
        print(f"{prog} {folder.name}: cannot adjust the grid's saved position in {Path(grid).name}, "
              f"laid out as this code does not know ({type(exc).__name__}: {exc}); resuming it as Tune "
              "saved it", file=out, flush=True)
        return True
    if changed:
        atomic_write(grid, cloudpickle.dumps(state))
    return True


def _trial_json(entry) -> dict:
    data = entry[0] if isinstance(entry, (list, tuple)) else entry
    return json.loads(data) if isinstance(data, str) else data


def _set_grid_position(state: dict, trials: list[dict]) -> bool:
    """Put Tune's grid generator (its saved ``state``) just past the ``trials`` the experiment holds.

    Only a plain grid is touched: one experiment, one sample, no preset points, variants listed
    eagerly. Its variants are generated again (a grid's order is fixed) and the first
    ``len(trials)`` skipped; the trials still to finish are the ones it counts as live, which is
    what holds ``max_concurrent``. Returns whether anything changed; raises ImportError,
    AttributeError, TypeError or KeyError on a Ray that lays the grid out otherwise.
    """
    from ray.tune.search.basic_variant import _VariantIterator
    from ray.tune.search.variant_generator import generate_variants

    iterators = state.get("_iterators") or []
    if len(iterators) != 1:
        return False
    it = iterators[0]
    if it.num_samples != 1 or it.points_to_evaluate or it.num_points_to_evaluate or it.lazy_eval:
        return False
    live = {t["trial_id"] for t in trials if t.get("status") != "TERMINATED"}
    n = len(trials)
    if it.counter == n and state.get("_live_trials") == live:
        return False
    variants = list(generate_variants(it.unresolved_spec, constant_grid_search=it.constant_grid_search,
                                      random_state=it.random_state))
    if n > len(variants):
        return False
    if n:
        it.variants, it.num_samples_left = _VariantIterator(variants[n:], lazy_eval=False), 0
    else:
        it.variants, it.num_samples_left = None, it.num_samples
    it.counter = n
    state["_live_trials"] = live
    state["_finished"] = n == len(variants)
    return True
