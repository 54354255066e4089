"""Which runs fed which: prepare and dedup → pretrain → finetune, vtab and fewshot.

A run's ``vitscale.lineage.<stage>`` tags (run ids, comma-separated) are taken at their word. A
stage a run has no such tag for (every stage, for a run logged before the tags existed) is
linked through the paths in its params: the run that last wrote a path before this run started
(a prepare's ``output``, a pretrain's ``output``/model.safetensors) is the one it read, and every
dedup of that shard set in between counts. The report says which of the two each link came from.
"""
from __future__ import annotations

import dataclasses
import posixpath

from reports.store import Run, Store, shard_set_name

LINEAGE_TAG = "vitscale.lineage."
UPSTREAM = ("prepare", "dedup", "pretrain", "finetune")
# VTAB task folders hold these three shard sets (transfer/vtab_data.py).
VTAB_SPLITS = ("train800", "val200", "test")


@dataclasses.dataclass
class Lineage:
    run: Run
    upstream: dict[str, list[str]]  # stage -> run ids, oldest first
    tagged: set[str]  # the stages whose ids came from the run's lineage tags; the others from paths

    @property
    def source(self) -> str:
        found = [s for s in UPSTREAM if self.upstream.get(s)]
        if found and all(s in self.tagged for s in found):
            return "tags"
        return "tags and paths" if self.tagged & set(found) else "paths"


def set_name(run: Run) -> str:
    """A prepare or dedup run's shard set, as its folder's name (``corpus``, ``digits/train800``)."""
    return shard_set_name(_norm(run.params.get("output") or run.params.get("shards") or ""))


def _norm(path: str) -> str:
    path = path.strip()
    if path.startswith("file://"):
        path = path[len("file://"):]
    return posixpath.normpath(path) if path and "://" not in path else path.rstrip("/")


def _task_dirs(run: Run) -> list[str]:
    """The task folders a vtab or fewshot run read (``--task [GROUP/]NAME=DIR``; ``--data-root DIR/<task>``)."""
    dirs = [spec.split("=", 1)[1] for spec in run.param_list("task") if "=" in spec]
    root = run.params.get("data_root")
    if root and root != "None":
        dirs += [posixpath.join(root, t.split("/")[-1]) for t in run.param_list("tasks")]
    return sorted({_norm(d) for d in dirs})


def reads(run: Run) -> tuple[list[str], list[str]]:
    """(shard sets, models) the run read, from its params."""
    p = run.params
    sets: list[str] = []
    models: list[str] = []
    if run.stage == "dedup":
        sets = [p.get("shards", "")]
    elif run.stage == "pretrain":
        sets = [p.get("data", ""), p.get("fewshot_data", "")]
    elif run.stage == "finetune":
        sets, models = [p.get("train", ""), p.get("test", "")], [p.get("pretrained", "")]
    elif run.stage in ("vtab", "fewshot"):
        sets = [posixpath.join(d, s) for d in _task_dirs(run) for s in VTAB_SPLITS]
        models = [p.get("pretrained", "")]
    keep = lambda xs: [_norm(x) for x in xs if x and x != "None"]  # noqa: E731
    return keep(sets), keep(models)


def writes(run: Run) -> list[str]:
    """The shard set or model the run wrote."""
    out = run.params.get("output")
    if not out or out == "None":
        return []
    out = _norm(out)
    if run.stage == "prepare":
        return [out]
    if run.stage in ("pretrain", "finetune"):
        from vitcore.checkpoint import MODEL_FILE  # vitcore loads torch; the report needs only this name

        return [out, posixpath.join(out, MODEL_FILE)]
    return []


class LineageIndex:
    def __init__(self, store: Store):
        self.store = store
        self._writers: dict[str, list[Run]] = {}
        for stage in ("prepare", "pretrain", "finetune"):
            for run in store.of_stage(stage):
                for path in writes(run):
                    self._writers.setdefault(path, []).append(run)
        self._dedups: dict[str, list[Run]] = {}
        for run in store.of_stage("dedup"):
            for path in reads(run)[0]:
                self._dedups.setdefault(path, []).append(run)
        self._cache: dict[str, Lineage] = {}

    def _writer(self, path: str, before: Run, stage: str) -> Run | None:
        """The last run of ``stage`` that wrote ``path`` and started before ``before`` did."""
        found = [r for r in self._writers.get(path, []) if r.stage == stage and r.start <= before.start
                 and r.id != before.id and r.status != "FAILED"]
        return max(found, key=lambda r: r.start) if found else None

    def of(self, run: Run) -> Lineage:
        if run.id not in self._cache:
            self._cache[run.id] = self._resolve(run)
        return self._cache[run.id]

    def _resolve(self, run: Run) -> Lineage:
        tagged = {s: [i.strip() for i in run.tags[LINEAGE_TAG + s].split(",") if i.strip()]
                  for s in UPSTREAM if LINEAGE_TAG + s in run.tags}
        up: dict[str, list[Run]] = {s: [] for s in UPSTREAM}
        sets, models = reads(run)
        for path in sets:
            prep = self._writer(path, run, "prepare")
            if prep is None:
                continue
            up["prepare"].append(prep)
            # Each dedup of the set between its prepare and this run removed rows this run skipped.
            up["dedup"] += [d for d in self._dedups.get(path, []) if prep.start <= d.start <= run.start
                            and d.id != run.id and d.status != "FAILED"]
        for path in models:
            pre = self._writer(path, run, "pretrain")
            if pre is None:
                continue
            up["pretrain"].append(pre)
            inherited = self.of(pre)
            for stage in ("prepare", "dedup"):
                up[stage] += [self.store.runs[i] for i in inherited.upstream[stage] if i in self.store.runs]
        ids = {s: list(dict.fromkeys(r.id for r in sorted(rs, key=lambda r: r.start))) for s, rs in up.items()}
        return Lineage(run, {**ids, **tagged}, set(tagged))

    def downstream(self, run_id: str) -> list[Run]:
        """Runs whose lineage names ``run_id`` (a pretrain's finetune, vtab and fewshot runs, say)."""
        out = []
        for stage in STAGES_FED:
            for r in self.store.of_stage(stage):
                if any(run_id in ids for ids in self.of(r).upstream.values()):
                    out.append(r)
        return sorted(out, key=lambda r: r.start)


STAGES_FED = ("dedup", "pretrain", "finetune", "vtab", "fewshot")
