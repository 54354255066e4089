"""The console of a Ray Tune sweep: plain lines per trial instead of Tune's boxes.

Tune's own output (experiment boxes, trial tables, the TensorBoard hint) is off
(``verbose=0``); :class:`TrialLines` prints, on the driver, a line when a trial finishes
or fails (trial, state, its metric) and a status line in between with the trials per
state and the latest result or start.
"""
from __future__ import annotations

from typing import Any, Sequence

from ray import tune

from common.progress import ProgressLine


def _lookup(config: dict, key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class TrialLines(tune.Callback):
    """Trial lines for sweep ``name``: trials labelled by config ``keys`` (dotted for nested), scored by ``metric``.

    Saved with the sweep's state so that a resumed sweep prints the same; the console
    stream is opened again after a restore, never pickled.
    """

    def __init__(self, name: str, keys: Sequence[str], metric: str) -> None:
        self.name, self.keys, self.metric = name, tuple(keys), metric
        self._line: ProgressLine | None = None

    def __getstate__(self) -> dict:
        return {"name": self.name, "keys": self.keys, "metric": self.metric, "_line": None}

    @property
    def line(self) -> ProgressLine:
        if self._line is None:
            self._line = ProgressLine(self.name)
        return self._line

    def label(self, trial) -> str:
        return " ".join(f"{k.rsplit('.', 1)[-1]}={_fmt(_lookup(trial.config, k))}" for k in self.keys)

    def score(self, result: dict | None) -> str:
        result = result or {}
        parts = [f"step {result['step']}"] if "step" in result else []
        if self.metric in result:
            parts.append(f"{self.metric} {result[self.metric]:.4f}")
        return ", ".join(parts) or "no result yet"

    def _states(self, trials, starting=None) -> str:
        counts: dict[str, int] = {}
        for t in trials:
            status = "RUNNING" if t is starting else t.status  # Tune calls on_trial_start just before
            counts[status] = counts.get(status, 0) + 1
        order = ("TERMINATED", "RUNNING", "PENDING", "PAUSED", "ERROR")
        words = {"TERMINATED": "done", "RUNNING": "running", "PENDING": "pending", "PAUSED": "paused", "ERROR": "failed"}
        return ", ".join(f"{counts[s]} {words[s]}" for s in order if counts.get(s)) + f" of {len(trials)}"

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self.line.update(f"{self._states(trials, trial)} | {self.label(trial)}: started")

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        self.line.update(f"{self._states(trials)} | {self.label(trial)}: {self.score(result)}")

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self.line.above(f"trial {self.label(trial)}: TERMINATED, {self.score(trial.last_result)}")

    def on_trial_recover(self, iteration, trials, trial, **info) -> None:
        self.line.above(f"trial {self.label(trial)}: failed, retrying ({trial.num_failures} failure(s) so far)")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self.line.above(f"trial {self.label(trial)}: ERROR after {trial.num_failures} failure(s); "
                        f"see {trial.error_file or 'its log'}")

    def on_experiment_end(self, trials, **info) -> None:
        self.line.close(self._states(trials))
