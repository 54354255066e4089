"""A ``prepare`` run's own files under its output folder, until :meth:`pipelines.output.OutputFolder.swap`.

- **The plan** (``.staging-plan-<uuid>/units-NNNNN.jsonl``): the input units in chunk files the
  pipeline reads, so neither its graph (which every Beam worker receives whole) nor the driver
  holds the plan while the job runs.
- **An attempt's staging folder** (``.staging-<uuid>/``): its shards, the spill files
  (:mod:`pipelines.spill`), the workers' counts and ``outputs.jsonl``, the small rows the
  driver reconciles (:mod:`pipelines.accounting`).

A killed run's leftovers are removed by the next run into the folder (:func:`clean_leftovers`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import uuid
from typing import Any, Iterable, Iterator, Mapping

from common.fs import atomic_write, url_to_fs
from pipelines import schema
from pipelines.sources import Unit

#: Units per plan chunk, and the fewest chunks a large plan is cut into.
UNITS_PER_CHUNK, MIN_PLAN_CHUNKS = 256, 64
OUTPUTS = "outputs.jsonl"


def jsonl(rows: Iterable[Mapping[str, Any]]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()


def clean_leftovers(fs, root: str) -> None:
    """Remove what a killed run may have left: temporary shard files and staging folders."""
    for path in fs.ls(root, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if schema.TMP_MARKER in name:
            fs.rm(path)
        elif name.startswith(".staging-"):
            fs.rm(path, recursive=True)


def new_folder(fs, root: str, kind: str = "") -> str:
    """A fresh ``.staging-[kind-]<uuid>`` folder under ``root``; returns its path."""
    path = f"{root}/.staging-{kind + '-' if kind else ''}{uuid.uuid4().hex}"
    fs.makedirs(path, exist_ok=True)
    return path


def write_plan(units: list[Unit], url: str) -> list[str]:
    """Write ``units`` as JSON-lines chunk files under ``url``; returns their paths.

    Enough chunks that every worker gets some; one unit each for a small corpus.
    """
    fs, root = url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    count = min(len(units), max(MIN_PLAN_CHUNKS, math.ceil(len(units) / UNITS_PER_CHUNK)))
    per = math.ceil(len(units) / count)
    paths = []
    for i in range(0, len(units), per):
        path = f"{root}/units-{len(paths):05d}.jsonl"
        with fs.open(path, "wt") as f:
            f.writelines(json.dumps(dataclasses.asdict(u)) + "\n" for u in units[i:i + per])
        paths.append(fs.unstrip_protocol(path))
    return paths


def read_plan_chunk(path: bytes) -> Iterator[Unit]:
    """The units of one chunk file :func:`write_plan` wrote (its path as bytes: Beam's str coder needs UTF-8)."""
    fs, p = url_to_fs(path.decode("utf-8", "surrogateescape"))
    with fs.open(p, "rt") as f:
        for line in f:
            d = json.loads(line)
            yield Unit(d["kind"], tuple(d["uris"]), tuple(tuple(x) for x in d["labels"]), d["index"],
                       tuple(d["error"]) if d["error"] else None)


def write_outputs(rows: list[dict], url: str) -> None:
    """The pipeline's small rows (counts, quarantine, duplicates, shard entries) as one file, through fsspec."""
    fs, path = url_to_fs(url)
    atomic_write(path, jsonl(rows), fs)


def read_outputs(fs, staging: str) -> list[dict]:
    rows = []
    for path in sorted(fs.glob(f"{staging}/outputs*")):
        with fs.open(path, "rt") as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return rows
