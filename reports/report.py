"""The comparison report (``jobs/report.py``): read the store, write one HTML file, log it as a ``report`` run."""
from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import field
from pathlib import Path
from typing import Any

from common import plots, tracking
from common.config import InputError
from common.fs import atomic_write
from common.jobenv import durable_path, is_url
from reports import compare, html, study
from reports.store import STAGES, Store, open_store

REPORT_FILE = "report.html"


@dataclasses.dataclass
class ReportConfig:
    """Compare runs of the MLflow store in one self-contained HTML report, logged as a `report` run."""

    output: str = field(default=REPORT_FILE, metadata={"recipe": False, "help": "the HTML file to write"})
    experiment: list[str] = field(default_factory=list, metadata={
        "help": "report on the runs of this MLflow experiment; repeatable (default: every experiment)"})
    run_id: list[str] = field(default_factory=list, metadata={
        "help": "report on this run, its child runs and, for a demo run, the stages it ran; repeatable"})


def _check_output(path: Path) -> None:
    """Refused before the store is read: a report that cannot be written is one line, not a traceback at the end."""
    if path.is_dir():
        raise InputError(f"output: {path} is a directory; give a file name such as {path / REPORT_FILE}")
    parent = path.parent
    if not parent.is_dir():
        raise InputError(f"output: the folder {parent} does not exist; create it or give another --output")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"output: {path} cannot be written (permission denied); give a writable --output")


def _check_selection(store: Store, cfg: ReportConfig) -> None:
    names = set(store.experiments.values())
    for name in cfg.experiment:
        if name not in names:
            known = ", ".join(sorted(names)) or "none"
            raise InputError(f"experiment: no experiment named {name!r} in {store.uri} (it has: {known}); "
                             "pass one of those, or leave --experiment out to cover every experiment")
    for rid in cfg.run_id:
        if rid not in store.runs:
            raise InputError(f"run_id: {rid!r} is not a vitscale run in {store.uri}; copy the id from the MLflow UI "
                             "or a stage's summary (mlflow_run_id)")


def make_plots(data: dict) -> dict[str, Any]:
    def labelled(entries: list[dict]) -> list[dict]:
        return [{**e, "label": e["run"].label} for e in entries]

    finetune: dict[str, bytes | None] = {}
    for group in dict.fromkeys(ent["group"] for ent in data["finetune"]):
        finetune[group] = plots.finetune_by_lr(labelled([ent for ent in data["finetune"] if ent["group"] == group]),
                                               f"fine-tuning {group}: accuracy per learning rate")
    pre = data["pretrain"]
    return {
        "pretrain_curves": plots.pretrain_curves([(r.label, pre["curves"].get(r.id, {})) for r in pre["runs"]]),
        "finetune": finetune,
        "vtab": plots.vtab_bars(labelled(data["vtab"])),
        "dedup": plots.dedup_bars(labelled(data["dedup"]["rows"]), data["dedup"]["test_sets"]),
    }


def run_report(cfg: ReportConfig, *, tags: dict[str, str] | None = None) -> dict[str, Any]:
    """Write the report to ``cfg.output`` and log it (and its plots) to a new ``report`` run; returns a summary."""
    if is_url(cfg.output):
        raise InputError(f"output: {cfg.output} is a URL; give a local file (the report also goes to MLflow as an "
                         "artifact, wherever the store keeps artifacts)")
    output = Path(durable_path(cfg.output, "output")).expanduser().resolve()
    _check_output(output)
    uri = tracking.tracking_uri()
    store = open_store(uri)
    _check_selection(store, cfg)
    runs = compare.selection(store, list(cfg.experiment), list(cfg.run_id))
    studies = study.studies(store, runs, list(cfg.experiment), list(cfg.run_id))
    if not runs and not studies:
        what = ("the selection " + " ".join([*(f"--experiment {x}" for x in cfg.experiment),
                                              *(f"--run-id {x}" for x in cfg.run_id)])
                if cfg.experiment or cfg.run_id else uri)
        raise InputError(f"{what} holds no {', '.join(STAGES)} runs to report on; run a stage first "
                         "(jobs/demo.py runs them all) or select other runs")
    data = compare.build(store, runs, studies)
    figures = make_plots(data)
    chosen = (", ".join([*(f"experiment {x}" for x in cfg.experiment), *(f"run {x}" for x in cfg.run_id)])
              or "every experiment")
    page = html.render(data, figures, store_uri=uri, selection=chosen)
    atomic_write(output, page)
    pngs = {"pretrain_curves": figures["pretrain_curves"], "vtab": figures["vtab"], "dedup": figures["dedup"],
            **{f"finetune {g}": png for g, png in figures["finetune"].items()},
            **{f"study {s['run'].id[:8]} {n.removesuffix('.png')}": png for s in data["studies"] for n, png in s["figures"].items()}}
    with tracking.start_run("report", params={"experiment": list(cfg.experiment), "run_id": list(cfg.run_id),
                                              "output": str(output)},
                            run_name="report " + (chosen if len(chosen) < 200 else f"{len(runs)} runs"),
                            tags={**tracking.run_tags(cfg), **(tags or {})}) as run:
        tracking.log_metrics({"runs": len(runs), **{f"runs.{s}": sum(r.stage == s for r in runs) for s in STAGES}})
        _log_bytes(page.encode("utf-8"), REPORT_FILE)  # one name in every report run, whatever --output says
        for name, png in pngs.items():
            if png:
                slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
                _log_bytes(png, f"plots/{slug}.png")
    return {"output": str(output), "runs": len(runs), "studies": [s.id for s in studies], "stages": {s: sum(r.stage == s for r in runs) for s in STAGES},
            "rankings": [{"group": r.title, "metric": r.metric, "best": r.runs[0].id, "verdict": r.verdict}
                         for r in data["rankings"]],
            "mlflow_run_id": run.info.run_id}


def _log_bytes(data: bytes, artifact_file: str) -> None:
    with tempfile.TemporaryDirectory(prefix="vitscale-report-") as tmp:
        path = Path(tmp) / Path(artifact_file).name
        path.write_bytes(data)
        folder = str(Path(artifact_file).parent)
        tracking.log_artifact(path, None if folder == "." else folder)
