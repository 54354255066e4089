"""VTAB-1k task folders (``train800/``, ``val200/``, ``test/`` shard sets): written from three
sources, and found and checked for a run (:func:`resolve_tasks`).

- ``tfds``: a registry task from TFDS-prepared data (``tensorflow-datasets`` must be installed and
  the dataset already prepared in ``--tfds-data-dir``; nothing is downloaded). The task's splits
  are cut as the registry says, labels computed by its label definition, and the images go
  through the Beam ingest like any corpus.
- ``folders``: raw downloads laid out as class folders, ``SRC/train/<class>/*`` and
  ``SRC/test/<class>/*`` with an optional ``SRC/val/<class>/*``. train800 is the first 800 files
  of train in a seeded order; val200 the first 200 of val (or the next 200 of train without one).
- ``split``: a deterministic train800/val200 split of any shard set (rows ordered by a seeded
  hash of their key, so the split does not depend on how the shards were written).

Every split of a task shares one label map, so a class absent from a small split keeps its id.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from dataclasses import field
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
from PIL import Image

from common.config import ConfigError, check, parse_named
from common.fs import atomic_write
from pipelines import schema
from pipelines.config import PrepareConfig
from pipelines.ingest import run_prepare
from training.task_folders import MissingTaskError, check_task_folder  # noqa: F401 (MissingTaskError: re-exported)
from transfer.vtab_tasks import GROUPS, SPLITS, TASKS, TRAIN_SIZE, VAL_SIZE, Task, custom_task

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm"}


@dataclasses.dataclass
class VtabPrepareConfig:
    """Write a VTAB-1k task folder (train800/, val200/, test/ shard sets)."""

    source: Literal["tfds", "folders", "split"] = field(metadata={"help": "tfds: a registry task from TFDS-prepared "
                                                                         "data; folders: class folders; split: "
                                                                         "train800/val200 of a shard set"})
    output: str = field(metadata={"recipe": False, "help": "the task folder to write (e.g. DATA_ROOT/dtd)"})
    task: str | None = field(default=None, metadata={"help": "registry task name (source tfds)"})
    input: str | None = field(default=None, metadata={"help": "class-folder root (folders) or shard set (split)"})
    tfds_data_dir: str | None = field(default=None, metadata={"help": "TFDS data_dir holding the prepared dataset"})
    train_size: int = field(default=TRAIN_SIZE, metadata={"help": "images in the train split (VTAB-1k: 800)"})
    val_size: int = field(default=VAL_SIZE, metadata={"help": "images in the val split (VTAB-1k: 200)"})
    train_name: str = field(default="train800", metadata={"help": "folder name of the train split"})
    val_name: str = field(default="val200", metadata={"help": "folder name of the val split"})
    size: int = field(default=384, metadata={"help": "shorter side of the stored images (prepare --size)"})
    upscale: bool = field(default=True, metadata={"help": "enlarge smaller images to --size (VTAB images are small)"})
    workers: int = field(default=1, metadata={"recipe": False, "help": "Beam workers"})
    seed: int = field(default=0, metadata={"help": "seed of the file order (folders) and row order (split)"})

    def __post_init__(self) -> None:
        check(self.train_size > 0 and self.val_size > 0, "train_size", "train and val sizes must be positive")
        if self.source == "tfds":
            check(self.task in TASKS, "task", f"{self.task!r} is not a registry task; known: {', '.join(TASKS)}")
            check(bool(self.tfds_data_dir), "tfds_data_dir", "pass the TFDS data_dir the dataset was prepared in")
        else:
            check(bool(self.input), "input", f"--source {self.source} needs --input")


def split_command(task: str, out: str, registry: bool) -> str:
    """The converter command that prepares ``task`` at ``out`` (for error messages and the README)."""
    if registry:
        return f"python jobs/vtab_prepare.py --source tfds --task {task} --tfds-data-dir TFDS_DIR --output {out}"
    return f"python jobs/vtab_prepare.py --source folders --input SRC --output {out}"


# -- writing shard sets ------------------------------------------------------------------------------

def write_subset(src, rows: np.ndarray, out: Path, *, note: dict) -> int:
    """Write rows ``rows`` of shard set ``src`` as a new one-shard set at ``out``; returns rows written."""
    table = pa.concat_tables([pa.Table.from_batches([b]) for b in src.iter_batches()]) if len(src) else None
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("shard-*.arrow"):
        old.unlink()
    (out / schema.MANIFEST).unlink(missing_ok=True)
    shards = []
    if table is not None and len(rows):
        part = table.take(pa.array(np.sort(rows))).sort_by(schema.KEY).cast(schema.SCHEMA)
        name = schema.shard_name(0)
        path = out / name
        with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, schema.SCHEMA) as writer:
            writer.write_table(part, max_chunksize=schema.BATCH_ROWS)
        shards.append({"path": name, "rows": part.num_rows, "bytes": path.stat().st_size,
                       "sha256": schema.file_sha256(path)})
    n = sum(s["rows"] for s in shards)
    manifest = {
        "schema_version": schema.SCHEMA_VERSION,
        "shards": shards,
        "num_rows": n,
        "label_map": dict(src.label_map),
        "counts": {"inputs": n, "written": n, "rejected_total": 0, "rejected": {}, "duplicates_total": 0,
                   "duplicates": {}},
        "config": note,
        "mlflow_run_id": src.manifest.get("mlflow_run_id"),
    }
    atomic_write(str(out / schema.MANIFEST), json.dumps(manifest, indent=2))
    return n


def _order(keys: list[str], seed: int) -> np.ndarray:
    digests = [hashlib.sha256(f"{seed}:{k}".encode("utf-8", "surrogateescape")).hexdigest() for k in keys]
    return np.argsort(np.asarray(digests), kind="stable")


def split_shard_set(src_dir: str | Path, out: str | Path, *, train_size: int = TRAIN_SIZE, val_size: int = VAL_SIZE,
                    seed: int = 0, train_name: str = "train800", val_name: str = "val200") -> dict[str, int]:
    """Deterministic train/val split of a shard set into ``out/train_name`` and ``out/val_name``."""
    from training.data import shard_keys

    src = schema.ShardSet(src_dir)
    if len(src) < train_size + val_size:
        raise ConfigError(f"input: {src_dir} has {len(src)} rows, fewer than --train-size {train_size} + "
                          f"--val-size {val_size}; give a larger shard set or smaller sizes")
    order = _order(shard_keys(src), seed)
    out = Path(out)
    note = {"derived_from": str(Path(src_dir).resolve()), "seed": seed}
    return {
        train_name: write_subset(src, order[:train_size], out / train_name, note={**note, "split": train_name}),
        val_name: write_subset(src, order[train_size:train_size + val_size], out / val_name,
                               note={**note, "split": val_name}),
    }


# -- from class folders ------------------------------------------------------------------------------

def _class_files(root: Path) -> dict[str, list[Path]]:
    if not root.is_dir():
        return {}
    return {d.name: sorted(p for p in d.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
            for d in sorted(root.iterdir()) if d.is_dir()}


def _ingest(files: list[tuple[Path, str]], out: Path, label_map: Path, cfg: VtabPrepareConfig, manifest: Path) -> dict:
    """Run the Beam ingest on ``(file, class)`` pairs, listed in a JSONL manifest at ``manifest``.

    The images are read where they are, so each row's ``source`` names the original file and its
    ``key`` (a hash of that uri) is the same on every run over the same folders: the split's row
    order, and with it training order and few-shot draws, repeats. (Copies in a temporary folder
    gave every run new keys, and sources that no longer existed.)"""
    # Whole or not at all: a run beside this one reads the same listing.
    atomic_write(manifest, "".join(json.dumps({"uri": str(path.resolve()), "label": cls}) + "\n"
                                   for path, cls in files).encode("utf-8", "surrogateescape"))
    result = run_prepare(PrepareConfig(input=[str(manifest)], output=str(out), size=cfg.size, upscale=cfg.upscale,
                                       workers=cfg.workers, label_map=str(label_map)))
    return result["counts"]


def from_folders(cfg: VtabPrepareConfig) -> dict[str, Any]:
    src, out = Path(cfg.input), Path(cfg.output)
    train, val, test = (_class_files(src / s) for s in ("train", "val", "test"))
    if not train or not test:
        raise ConfigError(f"input: {src} needs train/<class>/ and test/<class>/ folders of images "
                          "(and optionally val/<class>/)")
    classes = sorted(set(train) | set(val) | set(test))
    rng_key = lambda p: hashlib.sha256(f"{cfg.seed}:{p.relative_to(src)}".encode()).hexdigest()  # noqa: E731
    train_files = sorted(((p, c) for c, ps in train.items() for p in ps), key=lambda pc: rng_key(pc[0]))
    if val:
        val_files = sorted(((p, c) for c, ps in val.items() for p in ps), key=lambda pc: rng_key(pc[0]))[:cfg.val_size]
    else:
        val_files = train_files[cfg.train_size:cfg.train_size + cfg.val_size]
    train_files = train_files[:cfg.train_size]
    if len(train_files) < cfg.train_size or len(val_files) < cfg.val_size:
        raise ConfigError(f"input: {src} has {len(train_files)} train and {len(val_files)} val images, fewer than "
                          f"{cfg.train_size} and {cfg.val_size}; give smaller --train-size/--val-size")
    test_files = [(p, c) for c, ps in test.items() for p in ps]
    out.mkdir(parents=True, exist_ok=True)
    # The split listings and the label map stay in the task folder, beside the splits: each split's
    # shard set names its listing as its input, so a run again over the same folders names the same
    # input and may replace the set. (Listings in a temporary folder had a new name each run, and a
    # second run into the same output was refused as "a shard set of other inputs".)
    label_map = out / "label_map.json"
    atomic_write(label_map, json.dumps({c: i for i, c in enumerate(classes)}))
    counts = {name: _ingest(files, out / name, label_map, cfg, out / f"{name}.inputs.jsonl")
              for name, files in ((cfg.train_name, train_files), (cfg.val_name, val_files), ("test", test_files))}
    return {"output": str(out), "classes": len(classes), "counts": counts}


# -- from TFDS ---------------------------------------------------------------------------------------

def from_tfds(cfg: VtabPrepareConfig) -> dict[str, Any]:
    task = TASKS[cfg.task]
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise ConfigError(
            "source: --source tfds needs tensorflow-datasets, which is not installed; install it "
            "(pip install tensorflow-datasets tensorflow) and prepare the dataset with TFDS, or export the images "
            "as class folders and use --source folders"
        ) from None
    builder = tfds.builder(task.tfds, data_dir=cfg.tfds_data_dir)
    try:
        builder.info.splits  # noqa: B018  (raises when the dataset was never prepared there)
        if not builder.info.splits:
            raise ValueError("no splits")
    except Exception as exc:  # noqa: BLE001  (TFDS raises several types here)
        raise ConfigError(f"tfds_data_dir: {task.tfds} is not prepared in {cfg.tfds_data_dir} ({exc}); run TFDS's "
                          f"download_and_prepare for it there first") from None
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    with tempfile.TemporaryDirectory(prefix="vtab-tfds-") as tmp:
        label_map = Path(tmp) / "label_map.json"
        label_map.write_text(json.dumps({f"{c:03d}": c for c in range(task.num_classes)}))
        for name, split, limit in ((cfg.train_name, task.train_split, cfg.train_size),
                                   (cfg.val_name, task.val_split, cfg.val_size), ("test", task.test_split, None)):
            # Exported beside the output, not in the random temp dir: the keys hash the images'
            # paths, so a fixed place gives the same keys (and split order) on every run.
            export = out / f".tfds-export-{name}"
            if export.exists():
                shutil.rmtree(export)
            files = []
            ds = builder.as_dataset(split=split, shuffle_files=False)
            if limit is not None:
                ds = ds.take(limit)
            for i, ex in enumerate(tfds.as_numpy(ds)):
                img = np.asarray(ex["image"])
                if img.ndim == 3 and img.shape[2] == 1:
                    img = img[:, :, 0]
                if img.max() <= 1:  # dSprites stores 0/1 masks
                    img = img * 255
                label = task.label_fn(ex)
                cls = f"{label:03d}"
                path = export / cls / f"{i:06d}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(img.astype(np.uint8)).convert("RGB").save(path)
                files.append((path, cls))
            counts[name] = _ingest(files, out / name, label_map, cfg, Path(tmp) / f"{name}.jsonl")
            shutil.rmtree(export)
    return {"output": str(out), "task": task.name, "classes": task.num_classes, "counts": counts}


def run_vtab_prepare(cfg: VtabPrepareConfig) -> dict[str, Any]:
    if cfg.source == "tfds":
        return from_tfds(cfg)
    if cfg.source == "folders":
        return from_folders(cfg)
    counts = split_shard_set(cfg.input, cfg.output, train_size=cfg.train_size, val_size=cfg.val_size, seed=cfg.seed,
                             train_name=cfg.train_name, val_name=cfg.val_name)
    return {"output": cfg.output, "counts": counts,
            "next": f"write the test split with: python jobs/prepare.py --input TEST_SRC --output {cfg.output}/test"}


# -- reading task folders for a run ------------------------------------------------------------------

def _task_folders(data_root: str | None, task: list[str], no_flip: Sequence[str],
                  no_crop: Sequence[str]) -> dict[str, tuple[Task, Path, bool]]:
    """``{name: (task, folder, is a registry task)}`` from ``--data-root`` and ``--task``."""
    found: dict[str, tuple[Task, Path, bool]] = {}
    if data_root:
        root = Path(data_root).expanduser().resolve()
        for name, t in TASKS.items():
            found[name] = (t, root / name, True)
    for spec, value in parse_named(task, "task", example="dtd=/data/vtab/dtd").items():
        if spec in TASKS:
            found[spec] = (TASKS[spec], Path(value).expanduser().resolve(), True)
            continue
        group, sep, name = spec.partition("/")
        check(bool(sep) and group in GROUPS and bool(name), "task",
              f"{spec!r}: NAME must be a registry task ({', '.join(TASKS)}) or GROUP/NAME with GROUP one of "
              f"{', '.join(GROUPS)}")
        check(name not in found, "task", f"{spec!r}: {name!r} is already a task of this run")
        found[name] = (custom_task(group, name, flip=name not in no_flip, crop=name not in no_crop),
                       Path(value).expanduser().resolve(), False)
    for flag, names in (("no_flip", no_flip), ("no_crop", no_crop)):
        unknown = [n for n in names if n not in found]
        check(not unknown, flag, f"{', '.join(unknown)}: not a task of this run")
    return found


def resolve_tasks(data_root: str | None, task: list[str], *, no_flip: Sequence[str] = (),
                  no_crop: Sequence[str] = ()) -> dict[str, dict]:
    """Every task of a run: ``{name: {"dir", "group", "num_classes", "label_map", "flip", "crop", "registry"}}``.

    ``data_root`` holds every registry task; ``task`` adds ``NAME=DIR`` or ``GROUP/NAME=DIR``
    entries, and ``no_flip``/``no_crop`` name the user's tasks a flip or crop would relabel.
    Checked before any trial: each task folder must hold the three splits with one label map.
    """
    tasks = {}
    for name, (t, path, registry) in _task_folders(data_root, task, no_flip, no_crop).items():
        sets = check_task_folder(name, path, split_command(name, str(path), registry))
        classes = len(sets["train800"].label_map)
        if t.num_classes is not None and classes != t.num_classes:
            raise ConfigError(f"task {name}: {path} has {classes} classes, VTAB's {name} has {t.num_classes}; "
                              f"prepare it with: {split_command(name, str(path), True)}")
        tasks[name] = {"dir": str(path), "group": t.group, "num_classes": classes,
                       "label_map": sets["train800"].label_map, "flip": t.flip, "crop": t.crop, "registry": registry}
    return tasks


def split_dirs(tasks: dict[str, dict]) -> dict[str, Path]:
    """Every split folder of every task, named ``task/split`` (the shard sets a stage reads)."""
    return {f"{task}/{split}": Path(t["dir"]) / split for task, t in tasks.items() for split in SPLITS}


def task_records(tasks: dict[str, dict]) -> tuple[list[dict], list[dict]]:
    """The shard-set records (``pipelines.schema.shard_set_record``) of every split of every task
    that exists, named ``task/split``; and those of the training splits, the main inputs."""
    records, main = [], []
    for task, t in tasks.items():
        for split in SPLITS:
            d = Path(t["dir"]) / split
            if (d / schema.MANIFEST).is_file():
                r = {**schema.shard_set_record(d, role="evaluation" if split == "test" else "training"),
                     "name": f"{task}/{split}"}
                records.append(r)
                if split == "train800":
                    main.append(r)
    return records, main
