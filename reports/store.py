"""The vitscale runs of an MLflow store, read once: every run that carries a ``vitscale.stage`` tag.

Runs are found by that tag across every experiment, never by experiment name: the stages log to
one experiment or to one per stage (``vitscale-pretrain`` ...), and either layout reads the same.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from common.config import InputError

STAGE_TAG = "vitscale.stage"
PARENT_TAG = "mlflow.parentRunId"
# The top-level stages, in the order data flows; their children carry stage tags of their own
# (finetune-select, finetune-final, vtab-select, vtab-final, fewshot-task).
STAGES = ("prepare", "dedup", "pretrain", "finetune", "vtab", "fewshot")


@dataclasses.dataclass
class Run:
    id: str
    name: str
    stage: str
    experiment: str
    status: str
    start: int  # ms since the epoch
    end: int | None
    params: dict[str, str]
    metrics: dict[str, float]
    tags: dict[str, str]

    @property
    def parent(self) -> str | None:
        return self.tags.get(PARENT_TAG)

    @property
    def label(self) -> str:
        """What the report calls the run: its name and enough of its id to find it in the UI.

        A prepare or dedup run named only after its stage (every one before the tracking scheme's
        readable names) gets its shard set's folder name, so that five prepares read apart.
        """
        name = self.name
        if name == self.stage and self.stage in ("prepare", "dedup"):
            name = f"{name} {shard_set_name(self.params.get('output') or self.params.get('shards') or '')}"
        return f"{name} ({self.id[:8]})"

    def param_list(self, key: str) -> list[str]:
        """A list-valued param (logged as JSON by ``common.tracking.flatten``), or a one-item list."""
        value = self.params.get(key)
        if value in (None, "None", ""):
            return []
        if value.startswith("["):
            try:
                return [str(v) for v in json.loads(value)]
            except ValueError:
                pass
        return [value]


def shard_set_name(path: str) -> str:
    """A shard set's folder name (``corpus``), with its task for a VTAB split (``digits/train800``)."""
    parts = [p for p in path.rstrip("/").split("/") if p]
    if len(parts) > 1 and parts[-1] in ("train800", "val200", "test") and parts[-2] not in ("shards",):
        return "/".join(parts[-2:])
    return parts[-1] if parts else "?"


class Store:
    """Every vitscale run of the store at ``uri``, with its children and metric histories on demand."""

    def __init__(self, uri: str):
        import mlflow

        self.uri = uri
        self.client = mlflow.MlflowClient(uri)
        self.experiments = {e.experiment_id: e.name for e in _all(self.client.search_experiments)}
        runs = []
        if self.experiments:
            runs = _all(lambda **kw: self.client.search_runs(list(self.experiments), **kw))
        self.runs: dict[str, Run] = {}
        for r in runs:
            stage = r.data.tags.get(STAGE_TAG)
            if not stage:
                continue
            self.runs[r.info.run_id] = Run(
                id=r.info.run_id, name=r.info.run_name or stage, stage=stage,
                experiment=self.experiments.get(r.info.experiment_id, r.info.experiment_id),
                status=r.info.status, start=r.info.start_time or 0, end=r.info.end_time,
                params=dict(r.data.params), metrics=dict(r.data.metrics), tags=dict(r.data.tags))
        self._children: dict[str, list[Run]] = {}
        for run in self.runs.values():
            if run.parent:
                self._children.setdefault(run.parent, []).append(run)
        for kids in self._children.values():
            kids.sort(key=lambda r: r.start)
        self._history: dict[tuple[str, str], list[tuple[int, float]]] = {}

    def children(self, run_id: str, stage: str | None = None) -> list[Run]:
        return [r for r in self._children.get(run_id, []) if stage is None or r.stage == stage]

    def descendants(self, run_id: str) -> list[Run]:
        out, todo = [], [run_id]
        while todo:
            for kid in self._children.get(todo.pop(), []):
                out.append(kid)
                todo.append(kid.id)
        return out

    def of_stage(self, stage: str) -> list[Run]:
        return sorted((r for r in self.runs.values() if r.stage == stage), key=lambda r: r.start)

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) of one metric, in step order; a step logged twice keeps its last value."""
        if (run_id, key) not in self._history:
            by_step: dict[int, tuple[int, float]] = {}
            for m in self.client.get_metric_history(run_id, key):
                if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
                    by_step[m.step] = (m.timestamp, m.value)
            self._history[(run_id, key)] = [(s, v) for s, (_, v) in sorted(by_step.items())]
        return self._history[(run_id, key)]

    def artifact_json(self, run_id: str, path: str) -> Any | None:
        """A JSON artifact of the run, or None when it has none (an older run, a failed one)."""
        with tempfile.TemporaryDirectory(prefix="vitscale-report-") as tmp:
            try:
                local = self.client.download_artifacts(run_id, path, tmp)
                return json.loads(Path(local).read_text())
            except Exception:  # missing artifact, unreadable store location: the report says "not logged"
                return None


def _all(search) -> list:
    """Every page of an MLflow search (experiments or runs)."""
    out, token = [], None
    while True:
        page = search(max_results=1000, page_token=token)
        out.extend(page)
        token = getattr(page, "token", None)
        if not token:
            return out


def open_store(uri: str) -> Store:
    """The store at ``uri``; a local sqlite store that does not exist yet is an error, not a new empty database."""
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):]
        if not os.path.isfile(path):
            raise InputError(f"MLflow store: {path} does not exist; run a stage first (jobs/demo.py, jobs/prepare.py), "
                             "or point VITSCALE_HOME or MLFLOW_TRACKING_URI at the store to report on")
    return Store(uri)
