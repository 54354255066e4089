"""A downstream task folder: three labelled shard sets with one label map, ``train800/``,
``val200/`` and ``test/`` (jobs/vtab_prepare.py writes them). Few-shot evaluation fits on the
first two and scores on ``test``. Pre-training's few-shot scoring reads task folders as
transfer's stages do, so their layout and checks live here, below ``transfer/``.
"""
from __future__ import annotations

import re
from pathlib import Path

from common.config import ConfigError, InputError
from pipelines import schema

SPLITS = ("train800", "val200", "test")
FIT_SPLITS = ("train800", "val200")
TEST_SPLIT = "test"


class MissingTaskError(InputError):
    """A task folder or one of its splits is absent; the message names the converter command."""


def check_task_folder(name: str, path: Path, prepare: str) -> dict[str, schema.ShardSet]:
    """The three splits of task ``name`` at ``path``, refused in one line unless each is a non-empty,
    single-label shard set and all three share one label map; ``prepare`` is the command that writes one."""
    from training.data import check_labelled

    for split in SPLITS:
        if not (path / split / schema.MANIFEST).is_file():
            what = "does not exist" if not path.exists() else f"has no {split}/ shard set"
            raise MissingTaskError(f"task {name}: {path} {what}; prepare it with: {prepare}")
    sets = {s: schema.ShardSet(path / s) for s in SPLITS}
    maps = {s: sets[s].label_map for s in SPLITS}
    if not maps["train800"] == maps["val200"] == maps["test"]:
        raise ConfigError(f"task {name}: the label maps of {path}/train800, val200 and test differ; prepare the "
                          "three splits with the same --label-map (jobs/vtab_prepare.py does)")
    empty = [s for s in SPLITS if len(sets[s]) == 0]
    if empty:
        raise ConfigError(f"task {name}: {path}/{empty[0]} has no rows; check its quarantine.jsonl")
    for split in SPLITS:
        check_labelled(sets[split], f"task {name}", unlabelled_fix=f"a task needs labelled splits; prepare it with: "
                       f"{prepare}", several_fix="prepare it with one label a row")
    return sets


def task_folders(specs: list[str], field_name: str) -> dict[str, Path]:
    """``NAME=DIR`` entries (``GROUP/NAME=DIR`` too, as jobs/fewshot.py --task takes them) ->
    ``{NAME: absolute DIR}``; NAME keys the task's metrics, so it is a plain word."""
    from common.config import check, parse_named

    out: dict[str, Path] = {}
    for spec, folder in parse_named(specs, field_name, example="digits=/data/vtab/digits").items():
        name = spec.rpartition("/")[2]
        check(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) is not None, field_name,
              f"{spec!r}: NAME may hold letters, digits, '_', '.' and '-', e.g. digits=/data/vtab/digits")
        check(name not in out, field_name, f"{spec!r}: {name!r} is already a task of this run")
        out[name] = Path(folder).expanduser().resolve()
    return out


def check_task_folders(specs: list[str], field_name: str) -> dict[str, Path]:
    """:func:`task_folders`, each folder checked (:func:`check_task_folder`) before Ray starts."""
    folders = task_folders(specs, field_name)
    for name, path in folders.items():
        check_task_folder(name, path, f"python jobs/vtab_prepare.py --source folders --input SRC --output {path}")
    return folders


def task_records(folders: dict[str, Path]) -> list[dict]:
    """The shard-set records of every split of every task (``task/split``), read for evaluation."""
    return [{**schema.shard_set_record(path / split, role="evaluation"), "name": f"{name}/{split}"}
            for name, path in folders.items() for split in SPLITS]
