"""One self-contained HTML page: inline CSS, PNGs as data: URIs, no script and nothing fetched."""
from __future__ import annotations

import base64
import datetime
import html
from typing import Any

from common.plots import model_family, shot_keys, shot_name
from reports.compare import GROUPS, Ranking
from reports.store import Run

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:1250px;color:#1d1d1f;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em} h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:2em}
h3{margin-bottom:.3em} .meta{color:#666} code{background:#f3f3f3;padding:0 .25em;border-radius:3px}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:13px;display:block;overflow-x:auto;max-width:100%}
td{max-width:30em;overflow-wrap:break-word} th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f6f6} td.num{text-align:right;font-variant-numeric:tabular-nums}
td.diff{background:#fff1a8} tr.best td{font-weight:600} tr.sel td{background:#e6f4ea}
.verdict{background:#eef4ff;border-left:4px solid #4c72b0;padding:.5em .8em;margin:.5em 0}
img{max-width:100%;border:1px solid #eee} .none{color:#888;font-style:italic} details{margin:.3em 0 1em}
nav a{margin-right:1em}
"""

SECTIONS = (("summary", "Which run is better, and why"), ("study", "Scaling studies"),
            ("pretraining", "Pre-training curves"),
            ("finetuning", "Fine-tuning per learning rate"), ("vtab", "VTAB"), ("fewshot", "Few-shot"),
            ("dedup", "De-duplication against test sets"), ("lineage", "Lineage"))


def e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and value.is_integer() and 2 <= abs(value) < 1e15:
        return str(int(value))  # counts, steps: MLflow stores every metric as a float
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1e4 else f"{value:.4g}"
    return e(value)


def img(png: bytes | None, alt: str) -> str:
    if not png:
        return ""
    return f'<p><img alt="{e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}"></p>'


def table(head: list[str], rows: list[list[str]], row_classes: list[str] | None = None) -> str:
    """``rows`` hold ready-made cells (``<td ...>...</td>``)."""
    out = ["<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"]
    for i, cells in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        out.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def td(value: Any, *, numeric: bool = False, cls: str = "") -> str:
    classes = " ".join(c for c in ("num" if numeric else "", cls) if c)
    attr = f' class="{classes}"' if classes else ""
    return f"<td{attr}>{num(value) if numeric else e(value)}</td>"


def run_cell(run: Run) -> str:
    return f'<td title="{e(run.id)} in experiment {e(run.experiment)}">{e(run.label)}</td>'


def none(text: str) -> str:
    return f'<p class="none">{e(text)}</p>'


def _ranking(r: Ranking) -> str:
    best = r.values[r.runs[0].id]
    # A param named like a shown metric (steps: planned vs run) gets its own header, not a second "steps".
    head = ["#", "run", "experiment"] + r.shown_metrics + [
        f"{n} (param)" if n in r.shown_metrics else n for n in r.differing]
    rows, classes = [], []
    for i, run in enumerate(r.runs):
        cells = [td(i + 1, numeric=True), run_cell(run), td(run.experiment)]
        cells += [td(run.metrics.get(m), numeric=True, cls="key" if m == r.metric else "") for m in r.shown_metrics]
        for name in r.differing:
            value = r.values[run.id].get(name, "—")
            cells.append(td(value, cls="diff" if i and value != best.get(name, "—") else ""))
        rows.append(cells)
        classes.append("best" if i == 0 and len(r.runs) > 1 else "")
    order = "higher is better" if r.higher_is_better else "lower is better"
    same = "".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in sorted(r.same.items()))
    return (f"<h3>{e(r.title)}: ranked by <code>{e(r.metric or 'nothing comparable')}</code> ({order})</h3>"
            f'<div class="verdict">{e(r.verdict)}</div>'
            + table(head, rows, classes)
            + ("<p>Highlighted: a value that differs from the best run's. Params every run shares are folded below.</p>"
               if r.differing and len(r.runs) > 1 else "")
            + (f"<details><summary>{len(r.same)} params and inputs shared by every run here</summary>"
               f"<table>{same}</table></details>" if r.same else ""))


def _cells_note(data: dict) -> str:
    """Which selected pre-training runs are a study's cells, and where they are compared instead."""
    cell_of = data.get("cell_of", {})
    notes = []
    for s in data.get("studies", []):
        n = sum(cell_of.get(r.id) is s["run"] for r in data["runs"])
        if n:
            notes.append(f'<div class="verdict">{n} pre-training run{"s are cells" if n > 1 else " is a cell"} of study '
                         f"{e(s['run'].label)} (model × data fraction): compared in its section, by best few-shot "
                         "accuracy against images and exaFLOPs, not ranked here.</div>")
    return "\n".join(notes)


def _shots(rows: list[dict]) -> list[str]:
    """The few-shot columns' stems (``5``, ``digits_5``): ``<stem>shot_accuracy`` and ``<stem>shot_step``."""
    return [k.removesuffix("shot_accuracy") for k in shot_keys(rows)]


def _study_verdict(rows: list[dict], shots: list[str]) -> str:
    """Which model leads at the smallest and at the largest fraction, on the most shots (the paper's reading)."""
    key = f"{shots[-1]}shot_accuracy" if shots else ""
    scored = [r for r in rows if r.get(key) is not None]
    if not scored:
        return "No cell has a few-shot score yet."
    lines = []
    for fraction in sorted({min(r["fraction"] for r in scored), max(r["fraction"] for r in scored)}):
        at = sorted((r for r in scored if r["fraction"] == fraction), key=lambda r: r[key], reverse=True)
        lead = f"{at[0]['model']} leads with {at[0][key]:.3f}"
        rest = ", ".join(f"{r['model']} {r[key]:.3f}" for r in at[1:])
        lines.append(f"at fraction {fraction:g} ({num(at[0].get('images'))} images) {lead}"
                     + (f" (then {rest})" if rest else ", the only model scored there"))
    return f"Best {shot_name(key)} accuracy, " + "; ".join(lines) + "."


def _studies(entries: list[dict]) -> str:
    if not entries:
        return none("No scaling study (jobs/study.py) in the selection.")
    out = []
    for ent in entries:
        rows, shots = ent["rows"], _shots(ent["rows"])
        label_of = {c.id: c.label for c in ent["cells"]}
        body = [[td(r["model"]), td(model_family(r["model"])), td(f"{r['fraction']:g}", numeric=True),
                 td(r.get("images"), numeric=True), td(r.get("steps"), numeric=True),
                 td("—" if r.get("exaflops") is None else f"{r['exaflops']:.3g}", numeric=True)]
                + [c for k in shots for c in (td(r.get(f"{k}shot_accuracy"), numeric=True),
                                              td(r.get(f"{k}shot_step"), numeric=True))]
                + [td(label_of.get(r.get("mlflow_run_id"), r.get("mlflow_run_id") or "—"))] for r in rows]
        head = ["model", "family", "fraction", "images", "steps", "exaFLOPs"] + [
            h for k in shots for h in (f"best {shot_name(k + 'shot_accuracy')}", "at step")] + ["cell run"]
        states = ", ".join(f"{sum(c.status == st for c in ent['cells'])} {st.lower()}"
                           for st in dict.fromkeys(c.status for c in ent["cells"]))
        source = ("The table the study logged when it ended." if ent["from_artifact"] else
                  "The study has not logged its table (it is running, or was stopped): rebuilt from its finished "
                  "cells' metrics; the exaFLOPs come with the table it logs at its end.")
        out.append(f"<h3>{e(ent['run'].label)} <span class='meta'>{e(ent['run'].experiment)} · "
                   f"{len(ent['cells'])} cell runs ({e(states or 'none')})</span></h3>"
                   f'<div class="verdict">{e(_study_verdict(rows, shots))}</div>'
                   + table(head, body) + f"<p>{e(source)} Images: the training rows of the cell's nested subset; "
                   "exaFLOPs: vitcore's training FLOPs per image × images seen.</p>"
                   + "".join(img(png, name) for name, png in ent["figures"].items()))
    return "\n".join(out)


def _pretraining(section: dict, png: bytes | None, cell_of: dict[str, Run] | None = None) -> str:
    runs = section["runs"]
    if not runs:
        return none("No pre-training runs in the selection.")
    keys = ["train_loss", "train_accuracy", "holdout_accuracy", "images_per_second", "steps", "planned_steps"]
    keys += sorted({k for r in runs for k in r.metrics if k.startswith("fewshot_") and k.endswith("_accuracy")})
    keys = [k for k in keys if any(k in r.metrics for r in runs)]
    params = ["variant", "depth", "img_size", "epochs", "batch_size", "lr", "num_workers", "data"]
    params = [p for p in params if any(p in r.params for r in runs)]
    cell_of = cell_of or {}
    studied = any(r.id in cell_of for r in runs)
    rows = [[run_cell(r)] + ([td(cell_of[r.id].label if r.id in cell_of else "—")] if studied else [])
            + [td(r.metrics.get(k), numeric=True) for k in keys] + [td(r.params.get(p, "—")) for p in params]
            for r in runs]
    return (img(png, "pre-training curves") + "<p>Final values (the last logged point of each metric):</p>"
            + table(["run"] + (["cell of study"] if studied else []) + keys + params, rows))


def _finetuning(entries: list[dict], pngs: dict[str, bytes | None]) -> str:
    if not entries:
        return none("No fine-tuning runs in the selection.")
    out = []
    for group, png in pngs.items():
        out.append(f"<h3>{e(group)}</h3>" + img(png, f"fine-tuning accuracy per learning rate {group}"))
    for ent in entries:
        run = ent["run"]
        sel = ent["selected_lr"]
        rows, classes = [], []
        for t in ent["trials"]:
            chosen = sel is not None and abs(t["lr"] - sel) <= 1e-12 * max(1.0, abs(sel))
            rows.append([td(f"{t['lr']:g}", numeric=True), td(t.get("train_loss"), numeric=True),
                         td(t.get("val_accuracy"), numeric=True), td(t.get("test_accuracy"), numeric=True),
                         td(t.get("status", "")), td("selected (best val)" if chosen else "")])
            classes.append("sel" if chosen else "")
        result = (f"Retrained on all of train at lr {sel:g}: test accuracy {num(ent['test_accuracy'])} (the result)."
                  if sel is not None else "No learning rate was selected (the sweep did not finish).")
        out.append(f"<h3>{e(run.label)} <span class='meta'>{e(ent['group'])}</span></h3>"
                   + table(["lr", "train loss", "val acc", "test acc", "status", ""], rows, classes)
                   + f"<p>{e(result)} Val is the held-out part of train and alone chooses the rate; "
                     "the trials' test accuracy is shown for inspection.</p>")
    return "\n".join(out)


def _vtab(entries: list[dict], png: bytes | None) -> str:
    if not entries:
        return none("No VTAB runs in the selection.")
    tasks: list[tuple[str, str]] = []
    for g in list(GROUPS) + ["?"]:
        for ent in entries:
            tasks += [(g, n) for n, t in ent["tasks"].items() if t["group"] == g and (g, n) not in tasks]
    head = ["group", "task"] + [f"{ent['run'].label} {k}" for ent in entries for k in ("val", "test")]
    rows = []
    for g, n in tasks:
        cells = [td(g), td(n)]
        for ent in entries:
            t = ent["tasks"].get(n, {})
            cells += [td(t.get("val_accuracy"), numeric=True), td(t.get("test_accuracy"), numeric=True)]
        rows.append(cells)
    for g in GROUPS:
        if any(g in ent["groups"] for ent in entries):
            rows.append([td(f"{g} mean"), td("")] + [c for ent in entries
                                                     for c in (td(""), td(ent["groups"].get(g), numeric=True))])
    rows.append([td("VTAB mean (over tasks)"), td("")] + [c for ent in entries for c in (td(""), td(ent["mean"], numeric=True))])
    settings = "; ".join(f"{ent['run'].label}: " + ", ".join(f"{k} {v:g}" if isinstance(v, (int, float)) else f"{k} {v}"
                                                             for k, v in ent["setting"].items()) for ent in entries)
    return (table(head, rows) + f"<p>Chosen setting (best mean val accuracy): {e(settings)}.</p>"
            + img(png, "VTAB test accuracy per task"))


def _fewshot(entries: list[dict]) -> str:
    if not entries:
        return none("No few-shot runs in the selection.")
    out = []
    for ent in entries:
        shots = ent["shots"]
        rows = [[td(n), td(t["group"])] + [td(t.get(k), numeric=True) for k in shots] for n, t in ent["tasks"].items()]
        rows.append([td("mean"), td("")] + [td(ent["mean"].get(k), numeric=True) for k in shots])
        out.append(f"<h3>{e(ent['run'].label)}</h3>" + table(["task", "group"] + [f"{k}-shot" for k in shots], rows))
    return "\n".join(out)


def _dedup(section: dict, png: bytes | None) -> str:
    rows_in = section["rows"]
    if not rows_in:
        return none("No prepare or dedup runs in the selection.")
    sets = section["test_sets"]
    rows = [[run_cell(r["run"]), td(r["run"].stage), td(r["shard_set"]), td(r["total"], numeric=True),
             td(r["written"], numeric=True), td(r["rejected"], numeric=True), td(r["exact"], numeric=True)]
            + [td(r["counts"].get(t) if t in r["counts"] else None, numeric=True) for t in sets]
            for r in rows_in]
    return (table(["run", "stage", "shard set", "images (prepare: inputs; dedup: rows scanned)", "written",
                   "quarantined", "exact copies within the set"] + [f"removed: {t}" for t in sets], rows)
            + "<p>prepare removes near-duplicates of the test sets it was given while it ingests; dedup re-checks "
              "an existing shard set against new or changed test sets and lists what it removes in removed.jsonl. "
              "A dash: that run did not check that test set.</p>"
            + img(png, "near-duplicates removed per test set"))


def _lineage(entries: list[dict]) -> str:
    if not entries:
        return none("No dedup, pretrain, finetune, vtab or fewshot runs in the selection.")

    def names(items: list) -> str:
        if not items:
            return "—"
        return ", ".join(x.label if isinstance(x, Run) else f"{x[:8]} (not in this store)" for x in items)

    how = {"tags": "lineage tags", "paths": "inferred from paths in params",
           "tags and paths": "lineage tags, the rest inferred from paths"}
    finetuned = any(ent["upstream"].get("finetune") for ent in entries)
    rows = []
    for ent in entries:
        up = ent["upstream"]
        rows.append([run_cell(ent["run"]), td(ent["run"].stage), td(names(up.get("prepare", []))),
                     td(names(up.get("dedup", []))), td(names(up.get("pretrain", [])))]
                    + ([td(names(up.get("finetune", [])))] if finetuned else [])
                    + [td(names(ent["downstream"]) if ent["run"].stage == "pretrain" else ""), td(how[ent["source"]])])
    return (table(["run", "stage", "data: prepare runs", "data: dedup runs", "model: pretrain run"]
                  + (["model: finetune run"] if finetuned else []) + ["fed (finetune, vtab, fewshot)", "how known"], rows)
            + "<p>Runs logged with <code>vitscale.lineage.*</code> tags are linked by them. Older runs are linked "
              "through their params: the run that last wrote the shard set or model a run read, before it started.</p>")


def render(data: dict, plots: dict[str, Any], *, store_uri: str, selection: str) -> str:
    rankings: list[Ranking] = data["rankings"]
    stages: dict[str, int] = {}
    for r in data["runs"]:
        stages[r.stage] = stages.get(r.stage, 0) + 1
    counts = ", ".join(f"{n} {s}" for s, n in stages.items())
    body = {
        "summary": _cells_note(data) + ("\n".join(_ranking(r) for r in rankings)
                                         or none("No finished pretrain, finetune, vtab or fewshot runs to rank.")),
        "study": _studies(data.get("studies", [])),
        "pretraining": _pretraining(data["pretrain"], plots.get("pretrain_curves"), data.get("cell_of", {})),
        "finetuning": _finetuning(data["finetune"], plots.get("finetune", {})),
        "vtab": _vtab(data["vtab"], plots.get("vtab")),
        "fewshot": _fewshot(data["fewshot"]),
        "dedup": _dedup(data["dedup"], plots.get("dedup")),
        "lineage": _lineage(data["lineage"]),
    }
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    nav = "".join(f'<a href="#{k}">{e(t)}</a>' for k, t in SECTIONS)
    sections = "\n".join(f'<section id="{k}"><h2>{e(t)}</h2>\n{body[k]}\n</section>' for k, t in SECTIONS)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>vitscale run comparison</title>'
            f"<style>{CSS}</style></head><body>\n<h1>vitscale run comparison</h1>\n"
            f'<p class="meta">{e(now)} · store <code>{e(store_uri)}</code> · {e(selection)} · {e(counts)}</p>\n'
            f"<nav>{nav}</nav>\n{sections}\n</body></html>\n")
