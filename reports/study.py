"""A scaling study read as the paper reads it: its table, and its Figures 4 and 5 drawn from it.

``jobs/study.py`` writes the figures beside ``study_table.json`` and logs them to the study's
parent run; the report (:func:`study_section`) shows each study in its selection with its
table, read from that artifact, or rebuilt from its cells' metrics when the study did not end.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from common import plots, tracking
from common.fs import atomic_write
from reports.store import Run, Store

STUDY_STAGE = "study"
# Figure 4 (accuracy against images) and Figure 5 (accuracy against compute), by file name.
FIGURES = {"study_accuracy_by_images.png": plots.study_by_images,
           "study_accuracy_by_exaflops.png": plots.study_by_compute}
_BEST = "best_fewshot_"


def table_file() -> str:
    """The study table's name, as ``training.study`` writes it (imported here only: it loads torch)."""
    from training.study import TABLE

    return TABLE


def figures(rows: list[dict]) -> dict[str, bytes | None]:
    """Both figures of a study table's rows, by file name; None for a figure with nothing to draw."""
    return {name: draw(rows) for name, draw in FIGURES.items()}


def write_figures(table: dict[str, Any], output: str | Path) -> list[Path]:
    """Both figures into ``output`` (beside the table), and as artifacts of the study's parent run."""
    written = []
    for name, png in figures(table["rows"]).items():
        if png:
            path = Path(output).expanduser() / name
            atomic_write(path, png)
            written.append(path)
    if written:
        with tracking.start_run(STUDY_STAGE, run_id=table["mlflow_run_id"]):
            for path in written:
                tracking.log_artifact(path)
    return written


def run_and_draw(cfg) -> dict[str, Any]:
    """``jobs/study.py``: the study (:func:`training.study.run_study`), then both figures from its table."""
    from training.study import run_study

    table = run_study(cfg)
    return {**table, "figures": [str(p) for p in write_figures(table, cfg.output)]}


def study_of(run: Run, store: Store) -> Run | None:
    """The study whose cell ``run`` is: the study run it is linked to (nested, or by tag across experiments)."""
    for parent in (run.parent, run.tags.get(tracking.TAG_PARENT_RUN)):
        if parent in store.runs and store.runs[parent].stage == STUDY_STAGE:
            return store.runs[parent]
    return None


def studies(store: Store, runs: list[Run], experiments: list[str], run_ids: list[str]) -> list[Run]:
    """The studies of a selection: those it names (every one, when it names nothing) and those of its cells."""
    picked = {r.id for r in store.runs.values() if r.stage == STUDY_STAGE and (
        not experiments and not run_ids or r.experiment in experiments or r.id in run_ids)}
    picked |= {s.id for s in (study_of(r, store) for r in runs) if s is not None}
    return sorted((store.runs[i] for i in picked), key=lambda r: r.start)


def cells(store: Store, study: Run) -> list[Run]:
    """A study's pre-training runs, a killed or failed cell's too, in the order they started."""
    return sorted((r for r in store.runs.values() if r.stage == "pretrain" and study_of(r, store) is study),
                  key=lambda r: r.start)


def _row_from_cell(run: Run) -> dict[str, Any]:
    m = run.metrics
    shots = {k[len(_BEST):]: v for k, v in m.items()
             if k.startswith(_BEST) and (k.endswith("shot_accuracy") or k.endswith("shot_step"))}
    fraction = run.params.get("fraction")
    return {"model": run.params.get("variant", "?"), "fraction": float(fraction) if fraction not in (None, "None") else 1.0,
            "images": int(m["train_rows"]) if "train_rows" in m else None,
            "steps": int(m["steps"]) if "steps" in m else None, "exaflops": None,
            "best_step": int(m[_BEST + "step"]) if _BEST + "step" in m else None, "mlflow_run_id": run.id,
            **{k: int(v) if k.endswith("_step") else v for k, v in shots.items()}}


def study_section(store: Store, study_runs: list[Run]) -> list[dict]:
    """Per study: its table (the logged artifact, else rebuilt from the cells' metrics), its cells and figures."""
    out = []
    for study in study_runs:
        members = cells(store, study)
        table = store.artifact_json(study.id, table_file())
        logged = bool(table and isinstance(table.get("rows"), list))
        rows = table["rows"] if logged else [_row_from_cell(r) for r in members if r.status == "FINISHED"]
        out.append({"run": study, "rows": rows, "cells": members, "from_artifact": logged,
                    "figures": figures(rows)})
    return out
