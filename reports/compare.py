"""What the report says, as plain data: which runs are comparable, which is best, why, and each
stage's results (pre-training curves, fine-tuning per learning rate, VTAB, few-shot, dedup counts,
lineage). ``reports.html`` renders it and ``common.plots`` draws it.
"""
from __future__ import annotations

import dataclasses
import posixpath

from common.tracking import TAG_INPUT_DATA, TAG_INPUT_MANIFEST, TAG_NOT_RECIPE
from reports.lineage import LineageIndex, set_name
from reports.store import STAGES, Run, Store
from reports.study import study_section

GROUPS = ("natural", "specialized", "structured")
# Tags (from the tracking scheme) that say what a run was made of; compared like params.
WHAT_TAGS = {"vitscale.git_commit": "git commit", "vitscale.config_hash": "config hash",
             TAG_INPUT_DATA: "input data", "vitscale.dedup_state": "dedup state"}
PRETRAIN_CURVES = ("train_loss", "train_accuracy", "holdout_accuracy", "images_per_second")


@dataclasses.dataclass
class Ranking:
    """Comparable runs of one stage, best first, with the params that tell them apart."""

    stage: str
    title: str
    metric: str
    higher_is_better: bool
    runs: list[Run]
    shown_metrics: list[str]
    differing: list[str]  # param names (and "lineage: ..." / tag labels) whose values differ
    values: dict[str, dict[str, str]]  # run id -> {name: value} for every compared name
    same: dict[str, str]  # names whose values every run shares
    verdict: str


def selection(store: Store, experiments: list[str], run_ids: list[str]) -> list[Run]:
    """The top-level stage runs to report on (errors for names and ids the store lacks are raised by the caller)."""
    if not experiments and not run_ids:
        picked = set(store.runs)
    else:
        picked = {r.id for r in store.runs.values() if r.experiment in experiments}
        for rid in run_ids:
            run = store.runs[rid]
            picked.add(rid)
            picked.update(r.id for r in store.descendants(rid))
            # A demo run groups its stages by tag where they are not nested under it.
            picked.update(r.id for r in store.runs.values()
                          if rid in (r.tags.get("vitscale.demo_run_id"), r.tags.get("vitscale.parent_run_id")))
            if run.stage not in STAGES and run.parent in store.runs:  # a trial picks its sweep
                picked.add(run.parent)
    return sorted((store.runs[i] for i in picked if store.runs[i].stage in STAGES), key=lambda r: r.start)


def _fmt(value: float) -> str:
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.4g}"


def _group_parts(run: Run) -> tuple[str, str]:
    """(what the run is, the name of its data): runs on other data or with another objective share
    no scale, since a one-class set scores 1.000."""
    p = run.params
    if run.stage == "pretrain":
        return f"objective {p.get('objective', 'classification')} on", posixpath.basename(
            posixpath.normpath(p.get("data") or "?"))
    if run.stage == "finetune":
        name = p.get("dataset")
        if not name or name == "None":
            name = posixpath.basename(posixpath.normpath(p.get("train", "?")))
        return "on", name
    if run.stage in ("vtab", "fewshot"):
        tasks = run.param_list("tasks")
        return ("tasks " + ", ".join(sorted(t.split("/")[-1] for t in tasks)) if tasks else "tasks ?"), ""
    return "", ""


def _group_key(run: Run) -> str:
    kind, name = _group_parts(run)
    return f"{kind} {name}".strip()


def _data_key(run: Run) -> tuple[str, str]:
    """Runs are ranked together only when this is the same. What the shards hold (their sha256 and
    the label map) where the run logged it, whatever the folder is called, so that re-ingests of the
    same images meet; else the folder's name and its manifest's digest, for runs logged before it."""
    if run.stage not in ("pretrain", "finetune"):
        return _group_key(run), ""
    if run.tags.get(TAG_INPUT_DATA):
        return _group_parts(run)[0], run.tags[TAG_INPUT_DATA]
    return _group_key(run), run.tags.get(TAG_INPUT_MANIFEST, "")


def _titles(by_data: dict[tuple[str, str], list[Run]]) -> dict[str, list[Run]]:
    """Each group by its title: what its runs are and the names of their data; one name for two
    data sets is told apart by the digest of what they hold."""
    titles = {}
    for key, members in by_data.items():
        names = ", ".join(sorted({_group_parts(m)[1] for m in members}))
        titles[key] = f"{_group_parts(members[0])[0]} {names}".strip()
    names = list(titles.values())
    return {(f"{t} (data {key[1][:12]})" if key[1] and names.count(t) > 1 else t): by_data[key]
            for key, t in titles.items()}


def _key_metric(stage: str, runs: list[Run]) -> tuple[str, bool, list[str]]:
    """(metric ranked on, higher is better, metrics shown) for a group: the first preferred metric every run has."""
    prefs = {
        "pretrain": [("holdout_accuracy", True), ("fewshot_10shot_accuracy", True), ("fewshot_5shot_accuracy", True),
                     ("train_accuracy", True), ("train_loss", False)],
        # Ranked on the selection metric only: choosing by test accuracy would make it a validation set.
        "finetune": [("val_accuracy", True)],
        "vtab": [("vtab_mean", True)],
        "fewshot": [("10shot_mean", True), ("5shot_mean", True), ("25shot_mean", True), ("1shot_mean", True)],
    }[stage]
    shown = {
        "pretrain": ["holdout_accuracy", "train_accuracy", "train_loss", "fewshot_10shot_accuracy", "images_per_second",
                     "steps"],
        "finetune": ["val_accuracy", "test_accuracy", "selected_lr"],
        "vtab": ["vtab_mean", "vtab_natural", "vtab_specialized", "vtab_structured", "lr", "steps"],
        "fewshot": ["1shot_mean", "5shot_mean", "10shot_mean", "25shot_mean"],
    }[stage]
    for key, higher in prefs:
        if all(key in r.metrics for r in runs):
            return key, higher, [k for k in shown if any(k in r.metrics for r in runs)]
    for key, higher in prefs:
        if any(key in r.metrics for r in runs):
            return key, higher, [k for k in shown if any(k in r.metrics for r in runs)]
    return "", True, []


def _compared(run: Run, lineage: LineageIndex, store: Store) -> dict[str, str]:
    # Where and how a run executed is never why one is better: its stage's config marks those params.
    where = set(run.tags.get(TAG_NOT_RECIPE, "").split(","))
    values = {k: v for k, v in run.params.items() if k not in where}
    for tag, label in WHAT_TAGS.items():
        if tag in run.tags:
            values[label] = run.tags[tag]
    up = lineage.of(run).upstream
    for stage in ("pretrain", "finetune", "prepare", "dedup"):
        ids = up.get(stage, [])
        if ids or stage == "pretrain" and run.stage != "pretrain":
            values[f"lineage: {stage}"] = ", ".join(
                (store.runs[i].label if i in store.runs else i[:8]) for i in ids) or "none found"
    return values


def rank(store: Store, runs: list[Run], lineage: LineageIndex) -> list[Ranking]:
    out = []
    for stage in ("pretrain", "finetune", "vtab", "fewshot"):
        by_data: dict[tuple[str, str], list[Run]] = {}
        for r in runs:
            if r.stage == stage and r.status == "FINISHED":
                by_data.setdefault(_data_key(r), []).append(r)
        for key, members in _titles(by_data).items():
            metric, higher, shown = _key_metric(stage, members)
            missing = float("-inf") if higher else float("inf")
            members = sorted(members, key=lambda r: r.metrics.get(metric, missing), reverse=higher)
            values = {r.id: _compared(r, lineage, store) for r in members}
            names = sorted({n for v in values.values() for n in v})
            differing = [n for n in names if len({values[r.id].get(n, "—") for r in members}) > 1]
            same = {n: values[members[0].id][n] for n in names if n not in differing and n in values[members[0].id]}
            verdict = _verdict(members, metric, higher, differing, values,
                               schedule=_schedule_notes(members, store) if len(members) > 1 else [])
            out.append(Ranking(stage, f"{stage} {key}".strip(), metric, higher, members, shown, differing, values,
                               same, verdict))
    return out


def _schedule_notes(runs: list[Run], store: Store) -> list[str]:
    """How the best two runs' schedules differ: steps run and planned, and resumption.

    Params cannot tell: a time-boxed submission (``stop_after``) and its resumption share them.
    """
    best, second = runs[0], runs[1]
    notes = []

    def steps(r: Run) -> str:
        done, planned = r.metrics.get("steps"), r.metrics.get("planned_steps")
        if done is None:
            return "?"
        return f"{done:.0f}" + (f" of {planned:.0f} planned" if planned is not None and planned != done else "")

    if steps(best) != steps(second):
        notes.append(f"steps {steps(best)} vs {steps(second)}")

    def resumed(r: Run) -> bool:
        if r.metrics.get("restarts", 0) > 0 or r.metrics.get("resumed_from_step", 0) > 0:
            return True
        if "resumed_from_step" in r.metrics:
            return False
        # A run logged before resumed_from_step was: an earlier run of its name that stopped short
        # of its steps (a time-boxed submission); a finished run of the same name is a rerun.
        name = r.params.get("run_name")
        return bool(name and name != "None" and any(
            o.params.get("run_name") == name and o.stage == r.stage and o.start < r.start and o.id != r.id
            and o.metrics.get("steps", 0) < r.metrics.get("steps", 0) for o in store.runs.values()))

    flags = [resumed(best), resumed(second)]
    if any(flags):
        notes.append("resumed from a checkpoint: " + " vs ".join("yes" if f else "no" for f in flags))
    return notes


def _verdict(runs: list[Run], metric: str, higher: bool, differing: list[str], values: dict, *,
             schedule: list[str] = ()) -> str:
    if len(runs) == 1:
        return f"One run ({runs[0].label}); nothing to rank it against."
    best, second = runs[0], runs[1]
    if metric not in best.metrics:
        return f"No run logged {metric or 'a comparable metric'}; they cannot be ranked."
    b = best.metrics[metric]
    s = second.metrics.get(metric)
    head = (f"{best.label} is best on {metric}: {_fmt(b)}"
            + (f" against {_fmt(s)} for the runner-up {second.label} ({'+' if b >= s else ''}{_fmt(b - s)})."
               if s is not None else "."))
    if metric == "val_accuracy" and "test_accuracy" in best.metrics:
        head += f" Its result, test_accuracy, is {_fmt(best.metrics['test_accuracy'])}."
    diffs = [n for n in differing if values[best.id].get(n) != values[second.id].get(n)]
    when = f" Their schedules differ: {'; '.join(schedule)}." if schedule else ""
    if not diffs and schedule:
        return head + " The two share every param and input, but not the schedule, so the gap is not run-to-run " \
                      f"variation: {'; '.join(schedule)}."
    if not diffs:
        return head + (" The two share every param and input, so the gap is run-to-run variation "
                       "(seeding, data order, scheduling), not a setting.")
    shown = "; ".join(f"{n} {values[best.id].get(n, '—')} vs {values[second.id].get(n, '—')}" for n in diffs[:8])
    more = f" and {len(diffs) - 8} more" if len(diffs) > 8 else ""
    return f"{head} It differs from the runner-up in: {shown}{more}.{when}"


def pretrain_section(store: Store, runs: list[Run]) -> dict:
    pre = [r for r in runs if r.stage == "pretrain"]
    curves = {}
    for r in pre:
        keys = [k for k in PRETRAIN_CURVES if k in r.metrics] + sorted(
            k for k in r.metrics if k.startswith("fewshot_") and k.endswith("_accuracy"))
        curves[r.id] = {k: store.history(r.id, k) for k in keys}
    return {"runs": pre, "curves": curves}


def finetune_section(store: Store, runs: list[Run]) -> list[dict]:
    """Per finetune run: each selection trial's lr and scores, the selected lr, and the final result."""
    out = []
    for r in (r for r in runs if r.stage == "finetune"):
        trials = []
        for t in store.children(r.id, "finetune-select"):
            if "lr" not in t.params:
                continue
            trials.append({"lr": float(t.params["lr"]), "train_loss": t.metrics.get("train_loss"),
                           "val_accuracy": t.metrics.get("val_accuracy"), "test_accuracy": t.metrics.get("test_accuracy"),
                           "status": t.status})
        if not trials:  # children pruned, or a store copied without them: the summary has the rows
            summary = store.artifact_json(r.id, "finetune_summary.json") or {}
            trials = [{**t, "status": "FINISHED"} for t in summary.get("trials", [])]
        # A resumed sweep re-runs unfinished trials: one row per lr, the finished one where there is one.
        by_lr: dict[float, dict] = {}
        for t in trials:
            if t["lr"] not in by_lr or t["status"] == "FINISHED":
                by_lr[t["lr"]] = t
        final = [c for c in store.children(r.id, "finetune-final") if c.status == "FINISHED"]
        out.append({"run": r, "trials": [by_lr[k] for k in sorted(by_lr)],
                    "selected_lr": r.metrics.get("selected_lr"), "test_accuracy": r.metrics.get("test_accuracy"),
                    "final_run": final[-1] if final else None, "group": _group_key(r)})
    return out


def vtab_section(store: Store, runs: list[Run]) -> list[dict]:
    """Per vtab run: {task: group, val, test}, the group means and the overall mean."""
    out = []
    for r in (r for r in runs if r.stage == "vtab"):
        results = store.artifact_json(r.id, "vtab_results.json")
        if results and "tasks" in results:
            tasks = {n: {"group": t.get("group", "?"), "val_accuracy": t.get("val_accuracy"),
                         "test_accuracy": t.get("test_accuracy")} for n, t in results["tasks"].items()}
            groups, mean, setting = results.get("groups", {}), results.get("mean"), results.get("setting", {})
        else:  # rebuilt from the run's metrics and its final children's params
            group_of = {c.params.get("task"): c.params.get("group", "?") for c in store.descendants(r.id)}
            tasks = {k.split(".", 1)[1]: {"group": group_of.get(k.split(".", 1)[1], "?"), "val_accuracy": None,
                                          "test_accuracy": v}
                     for k, v in r.metrics.items() if k.startswith("test_accuracy.")}
            groups = {g: r.metrics[f"vtab_{g}"] for g in GROUPS if f"vtab_{g}" in r.metrics}
            mean = r.metrics.get("vtab_mean")
            setting = {k: r.metrics[k] for k in ("lr", "steps") if k in r.metrics}
        if tasks:
            out.append({"run": r, "tasks": tasks, "groups": groups, "mean": mean, "setting": setting})
    return out


def fewshot_section(store: Store, runs: list[Run]) -> list[dict]:
    out = []
    for r in (r for r in runs if r.stage == "fewshot"):
        shots = sorted({int(k[:-len("shot_mean")]) for k in r.metrics if k.endswith("shot_mean")})
        tasks = {}
        for c in store.children(r.id, "fewshot-task"):
            tasks[c.params.get("task", c.name)] = {
                "group": c.params.get("group", "?"),
                **{k: c.metrics.get(f"{k}shot_mean") for k in shots}}
        out.append({"run": r, "shots": shots, "mean": {k: r.metrics.get(f"{k}shot_mean") for k in shots},
                    "tasks": tasks})
    return out


def dedup_section(runs: list[Run]) -> dict:
    """Images removed per test set: by each prepare (while ingesting) and each dedup (re-checking a shard set)."""
    rows, test_sets = [], set()
    for r in runs:
        if r.stage == "prepare":
            counts = {k[len("duplicates."):]: int(v) for k, v in r.metrics.items() if k.startswith("duplicates.")}
            exact = counts.pop("corpus", None)
            named = {spec.split("=", 1)[0] for spec in r.param_list("test_set") if "=" in spec}
            counts = {**{n: 0 for n in named}, **counts}
            total = r.metrics.get("inputs")
            written, rejected = r.metrics.get("written"), r.metrics.get("rejected")
        elif r.stage == "dedup":
            counts = {k[len("removed."):]: int(v) for k, v in r.metrics.items() if k.startswith("removed.")}
            named = {spec.split("=", 1)[0] for spec in r.param_list("test_set") if "=" in spec}
            counts = {**{n: 0 for n in named}, **counts}
            exact, total = None, r.metrics.get("rows_scanned")
            written = rejected = None
        else:
            continue
        test_sets.update(counts)
        # Counts, not measurements: MLflow keeps them as floats, and 0.0 printed as "0.000" images.
        total, exact, written, rejected = (None if v is None else int(v) for v in (total, exact, written, rejected))
        rows.append({"run": r, "shard_set": set_name(r), "counts": counts, "exact": exact, "total": total,
                     "written": written, "rejected": rejected})
    return {"rows": rows, "test_sets": sorted(test_sets)}


def lineage_section(store: Store, runs: list[Run], lineage: LineageIndex) -> list[dict]:
    """For each model-producing or model-reading run: what fed it, and (pretrain) what it fed."""
    out = []
    for r in runs:
        if r.stage not in ("pretrain", "finetune", "vtab", "fewshot", "dedup"):
            continue
        lin = lineage.of(r)
        fed = lineage.downstream(r.id) if r.stage == "pretrain" else []
        out.append({"run": r, "upstream": {s: [store.runs.get(i) or i for i in ids] for s, ids in lin.upstream.items()},
                    "source": lin.source, "downstream": fed})
    return out


def build(store: Store, runs: list[Run], studies: list[Run] = ()) -> dict:
    """Every section's data. A study's cells are compared in its own section, by its measure (best
    few-shot accuracy against images and compute), not ranked against each other as unrelated runs."""
    lineage = LineageIndex(store)
    study_data = study_section(store, list(studies))
    cell_of = {c.id: s["run"] for s in study_data for c in s["cells"]}
    return {
        "runs": runs,
        "rankings": rank(store, [r for r in runs if r.id not in cell_of], lineage),
        "studies": study_data,
        "cell_of": cell_of,
        "pretrain": pretrain_section(store, runs),
        "finetune": finetune_section(store, runs),
        "vtab": vtab_section(store, runs),
        "fewshot": fewshot_section(store, runs),
        "dedup": dedup_section(runs),
        "lineage": lineage_section(store, runs, lineage),
    }


