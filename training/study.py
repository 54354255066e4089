"""A scaling study: a grid of pre-training runs (model x nested data fraction), read as the paper
reads Figures 4 and 5: each cell's best few-shot accuracy against its images and its compute.

Each cell is one :func:`training.pretrain.run_pretrain` run of the recipe (``--config``), with
``--fraction`` and few-shot scoring during training on the downstream task folders (``--task``,
each task and shot count scored and kept apart, :mod:`training.best`), in a folder of its own
under ``output/cells``, under one MLflow parent run. The unfinished cells run as the trials of
one Ray Tune experiment (:mod:`training.study_trials`), ``--cells-at-once`` of them side by side
(by default as many as the cluster's CPUs hold), each trial a Ray Train run on the workers it is
given; one at a time, they run in this process. A cell whose summary is written is finished:
the same command run again skips it, and an interrupted cell resumes from its checkpoint into its
own MLflow run.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

from common import tracking
from common.config import ConfigError, check, from_dict, load_file
from common.fs import atomic_write, make_output_dir
from common.locks import FolderLock, check_owner, check_same_data, claim_folder, reading
from pipelines.schema import MANIFEST, ShardSet, missing_manifest_hint, shard_set_record
from training.pretrain import SUMMARY, PretrainConfig, data_digests, read_run_record, read_sets
from training.task_folders import check_task_folders, task_folders, task_records

STUDY_RECORD = "study.json"
# A recipe's ViT size overrides (a tiny ViT for a small study); a BiT ResNet's size is in its name.
VIT_SIZE = ("depth", "width", "mlp_dim", "num_heads")
TABLE = "study_table.json"
# A cell's best few-shot score in the table: per task (--task NAME), or unprefixed for --fewshot-data.
SHOT_KEY = re.compile(r"(?:(.+)_)?(\d+)shot_accuracy")


@dataclasses.dataclass
class StudyConfig:
    """Pre-train every model on every nested fraction of a shard set; compare best few-shot accuracy."""

    data: str = field(metadata={"recipe": False, "help": "shard directory written by jobs/prepare.py"})
    task: list[str] = field(default_factory=list, metadata={"recipe": False, "help": "NAME=DIR, repeatable: a downstream task folder (train800/, val200/, test/, as jobs/fewshot.py --task reads it) every cell is few-shot scored on during training: fit on train800 and val200, scored on test"})
    config: str | None = field(default=None, metadata={"metavar": "FILE", "recipe": False, "help": "the pre-training recipe, a YAML or JSON file as jobs/pretrain.py --config takes"})
    fewshot_data: str | None = field(default=None, metadata={"recipe": False, "help": "a labelled shard set every cell is also few-shot scored on, split in half for fit and test"})
    output: str = field(default="study_output", metadata={"recipe": False, "help": "directory for the cells, the table and the study's record"})
    models: list[str] = field(default_factory=lambda: ["Ti/16", "BiT-R50x1"], metadata={"help": "variants, comma-separated, e.g. Ti/16,BiT-R50x1,R50+Ti/16"})
    fractions: list[float] = field(default_factory=lambda: [0.03, 0.1, 0.3, 1.0], metadata={"help": "nested data fractions in (0, 1], comma-separated"})
    budget: Literal["epochs", "steps"] = field(default="epochs", metadata={"help": "epochs: every cell makes the same passes over its subset; steps: every cell the same optimiser steps"})
    epochs: int | None = field(default=None, metadata={"help": "passes over each cell's subset (--budget epochs)"})
    steps: int | None = field(default=None, metadata={"help": "optimiser steps per cell (--budget steps)"})
    batch_size: int | None = field(default=None, metadata={"help": "override the recipe's global batch for every cell"})
    img_size: int | None = field(default=None, metadata={"help": "override the recipe's resolution for every cell"})
    shots: list[int] | None = field(default=None, metadata={"help": "images per class of the few-shot scoring, e.g. 5,10; default: 1, 5, 10 and 25, those every class can fill"})
    fewshot_every: int = field(default=100, metadata={"help": "few-shot scoring interval in steps, in every cell"})
    data_changed_ok: bool = field(default=False, metadata={"recipe": False, "help": "go on with the study even though "
                                                                                  "a shard set it reads was replaced since its cells started"})
    cells_at_once: int = field(default=0, metadata={"recipe": False, "metavar": "N", "help": "cells pre-trained side by side, each a Ray Tune trial "
                                                   "driving its own Ray Train run; 0: as many as the cluster's CPUs hold "
                                                   "(its CPUs // a cell's workers' CPUs, at least 1); 1: one after another"})

    def __post_init__(self) -> None:
        # Variant names hold no commas: "--models Ti/16,BiT-R50x1" is a list (the runner keeps commas in strings).
        self.models = [m.strip() for v in self.models for m in v.split(",") if m.strip()]
        check(bool(self.models), "models", "name at least one variant, e.g. --models Ti/16,BiT-R50x1")
        from vitcore.variants import decode_bit_variant, decode_variant, is_bit_variant

        for model in self.models:
            try:
                decode_bit_variant(model) if is_bit_variant(model) else decode_variant(model)
            except ValueError as exc:
                raise ConfigError(f"models: {exc}") from None
        check(bool(self.fractions), "fractions", "name at least one fraction, e.g. --fractions 0.1,1")
        for f in self.fractions:
            check(0 < f <= 1, "fractions", f"{f} is outside (0, 1]; e.g. --fractions 0.03,0.1,0.3,1")
        check(self.budget != "steps" or self.steps is not None, "steps", "--budget steps needs --steps N")
        check(self.budget != "epochs" or self.steps is None, "steps", "--steps sets a step budget: add --budget steps")
        check(self.fewshot_every > 0, "fewshot_every", f"must be a positive integer, got {self.fewshot_every}")
        check(self.cells_at_once >= 0, "cells_at_once", f"must be 0 (as many as the cluster holds) or a count of "
              f"cells, e.g. --cells-at-once 2; got {self.cells_at_once}")
        check(bool(self.task or self.fewshot_data), "task", "score the cells on at least one downstream task: "
              "--task NAME=DIR (a folder of train800/, val200/ and test/ shard sets), or --fewshot-data DIR")
        check(self.shots is None or (bool(self.shots) and min(self.shots) > 0), "shots",
              f"must be positive shot counts, e.g. --shots 5,10; got {self.shots}")
        task_folders(self.task, "task")


def cell_name(model: str, fraction: float) -> str:
    return f"{re.sub(r'[^A-Za-z0-9.+-]', '', model)}_f{fraction:g}"


def cell_configs(cfg: StudyConfig) -> list[PretrainConfig]:
    """Every cell's pre-training config, checked (an unknown model is refused here, in one line)."""
    from vitcore.variants import is_bit_variant

    recipe = load_file(cfg.config) if cfg.config else {}
    for name in ("data", "output", "variant", "fraction", "fewshot_data", "fewshot_task", "fewshot_shots",
                 "fewshot_every", "run_name", "data_changed_ok"):
        recipe.pop(name, None)
    if cfg.budget == "steps":
        length = {"steps": cfg.steps}
    else:  # the same passes over every subset: the recipe's epochs (or --epochs), never its steps
        length = {"steps": None, **({"epochs": cfg.epochs} if cfg.epochs else {})}
    overrides = {k: v for k, v in (("batch_size", cfg.batch_size), ("img_size", cfg.img_size)) if v is not None}
    cells = []
    for model in cfg.models:
        for fraction in cfg.fractions:
            sized = {k: v for k, v in recipe.items() if not (is_bit_variant(model) and k in VIT_SIZE)}
            values = {**sized, **overrides, **length, "data": cfg.data, "variant": model, "fraction": fraction,
                      "fewshot_data": cfg.fewshot_data, "fewshot_task": list(cfg.task), "fewshot_shots": cfg.shots,
                      "fewshot_every": cfg.fewshot_every, "data_changed_ok": cfg.data_changed_ok,
                      "output": str(Path(cfg.output) / "cells" / cell_name(model, fraction))}
            cells.append(from_dict(PretrainConfig, values, source=cfg.config or "study"))
    return cells


def _check_inputs(cfg: StudyConfig) -> None:
    """Before Ray starts: the shard sets and task folders exist, and every fraction leaves training rows."""
    from training.data import shard_keys, training_mask

    for name in ("data", "fewshot_data"):
        if getattr(cfg, name) is None:
            continue
        path = Path(getattr(cfg, name)).expanduser()
        if not (path / MANIFEST).is_file():
            raise ConfigError(f"{name}: {path} has no {MANIFEST}; {missing_manifest_hint(path)}")
    check_task_folders(cfg.task, "task")
    keys = shard_keys(ShardSet(str(Path(cfg.data).expanduser())))
    holdout = cell_configs(cfg)[0].holdout
    for f in cfg.fractions:
        if not training_mask(keys, holdout, f).any():
            raise ConfigError(f"fractions: {f} of {cfg.data} selects no training rows; raise it or drop it")


def cell_row(cell: PretrainConfig, summary: dict) -> dict[str, Any]:
    """A cell's line of the table: images, steps, exaFLOPs (vitcore's count x images seen), best few-shot."""
    import vitcore

    model = vitcore.load_checkpoint(summary["model"])
    seen = summary["steps"] * cell.batch_size
    best = summary.get("best_fewshot") or {}
    return {"model": cell.variant, "fraction": cell.fraction, "images": summary["train_rows"],
            "steps": summary["steps"], "exaflops": vitcore.train_flops_per_image(model) * seen / 1e18,
            "best_step": best.get("step"), "mlflow_run_id": summary["mlflow_run_id"],
            **{k: v for k, v in best.items() if k.endswith("shot_accuracy") or k.endswith("shot_step")}}


def run_study(cfg: StudyConfig) -> dict[str, Any]:
    """Run the grid's unfinished cells as Ray Tune trials (:mod:`training.study_trials`); returns the
    table, one row per cell in the grid's order."""
    cells = cell_configs(cfg)
    _check_inputs(cfg)
    output = Path(cfg.output).expanduser().resolve()
    check_owner(output, "study")
    # Every cell reads the same sets: none is replaced between cells.
    with reading("study", read_sets(cells[0])), \
            FolderLock(make_output_dir(output), "study"):
        claim_folder(output, "study")
        with _parent_run(cfg, output) as parent:
            labels = {i: f"{i + 1}/{len(cells)} {c.variant} at fraction {c.fraction:g}" for i, c in enumerate(cells)}
            todo = {i: c for i, c in enumerate(cells) if not _finished(c, labels[i])}
            if todo:
                from training.ray_utils import init_ray
                from training.study_trials import run_cells

                init_ray(cells[0].ray_address)
                run_cells(todo, labels, parent.info.run_id, output, cfg.cells_at_once)
            rows = [cell_row(c, json.loads((Path(c.output) / SUMMARY).read_text())) for c in cells]
            table = {"rows": rows, "mlflow_run_id": parent.info.run_id}
            tracking.log_dict(table, TABLE)
        atomic_write(output / TABLE, json.dumps(table, indent=2))
    print(format_table(rows), file=sys.stderr)
    return table


def _finished(cell: PretrainConfig, label: str) -> bool:
    """Whether the cell's summary is written (it is skipped, in a line), after checking it was made
    from the data the other cells read."""
    if not (Path(cell.output) / SUMMARY).is_file():
        return False
    check_same_data(read_run_record(Path(cell.output)).get("data"), data_digests(cell), stage="study", what="cell",
                    fix=f"remove {cell.output} to pre-train that cell again", changed_ok=cell.data_changed_ok)
    print(f"study: cell {label}: finished, skipped", file=sys.stderr)
    return True


def _parent_run(cfg: StudyConfig, output: Path):
    """The study's MLflow run: the one ``output`` records (a rerun adds to it), else a new one."""
    from mlflow.exceptions import MlflowException

    try:
        recorded = json.loads((output / STUDY_RECORD).read_text()).get("mlflow_run_id")
        tracking.get_run(recorded)
    except (OSError, ValueError, AttributeError, MlflowException):  # no record, a damaged one, a run not in the store
        recorded = None
    if recorded:
        return tracking.start_run("study", run_id=recorded)
    record = shard_set_record(cfg.data, role="training")
    tasks = task_records(task_folders(cfg.task, "task"))
    opened = tracking.start_run("study", params=dataclasses.asdict(cfg), run_name=f"study on {record['name']}",
                                tags=tracking.run_tags(cfg, data=[record, *tasks], main=[record]))
    return _Recorded(opened, output)


class _Recorded:
    """A new parent run whose id is written into ``output`` as soon as it opens."""

    def __init__(self, opened, output: Path) -> None:
        self.opened, self.output = opened, output

    def __enter__(self):
        run = self.opened.__enter__()
        atomic_write(self.output / STUDY_RECORD, json.dumps({"mlflow_run_id": run.info.run_id}))
        return run

    def __exit__(self, *exc):
        return self.opened.__exit__(*exc)


def _shot_columns(rows: list[dict]) -> list[str]:
    """The table's ``[<task>_]<k>shot_accuracy`` keys, by task (the --fewshot-data set first), then shot count."""
    found = {k for r in rows for k in r if SHOT_KEY.fullmatch(k)}

    def order(k: str) -> tuple[str, int]:
        task, k_shots = SHOT_KEY.fullmatch(k).groups()
        return task or "", int(k_shots)

    return sorted(found, key=order)


def format_table(rows: list[dict]) -> str:
    """The study's table: model, fraction, images, steps, exaFLOPs, best few-shot per task and shot count, its step."""
    shots = _shot_columns(rows)
    names = [k.removesuffix("_accuracy").replace("_", " ") for k in shots]
    widths = [max(9, len(n) + 1) for n in names]
    head = f"{'model':<14}{'fraction':>9}{'images':>9}{'steps':>7}{'exaFLOPs':>11}"
    head += "".join(f"{n:>{w}}{'step':>6}" for n, w in zip(names, widths))
    lines = [head]
    for r in rows:
        line = f"{r['model']:<14}{r['fraction']:>9g}{r['images']:>9}{r['steps']:>7}{r['exaflops']:>11.3g}"
        for k, w in zip(shots, widths):
            acc, step = r.get(k), r.get(k.removesuffix("_accuracy") + "_step")
            line += f"{acc:>{w}.3f}{step:>6}" if acc is not None else f"{'-':>{w}}{'-':>6}"
        lines.append(line)
    return "\n".join(lines)
