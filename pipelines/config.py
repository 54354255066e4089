"""The ``prepare`` stage config: one typed dataclass, loadable from YAML and overridable by flags."""
from __future__ import annotations

import dataclasses
import os
from typing import Literal

from common.config import InputError, check, parse_named
from common.fs import normalize_root
from pipelines.decode import DEFAULT_MAX_FILE_MB, DEFAULT_MAX_MEGAPIXELS

#: The Beam metrics namespace of the ingest's counters (``beam.*`` metrics in MLflow).
NAMESPACE = "prepare"


class PrepareError(InputError):
    """A usage error found before the pipeline starts (missing input, bad label map, output inside an input)."""


def parse_test_sets(specs: list[str], field_name: str = "test_set") -> dict[str, str]:
    """``--test-set NAME=SRC`` as an ordered mapping; ``corpus`` names in-corpus duplicates, so it is reserved."""
    return parse_named(specs, field_name, example="cifar10=/data/cifar10/test",
                       reserved={"corpus": "'corpus' is reserved for in-corpus duplicates"})


#: The runners ``--runner`` accepts. ``direct`` is the DirectRunner; ``dask`` is Beam's DaskRunner with the
#: fixes in :mod:`pipelines.dask_runner`. The others need their cluster or cloud project (infra/beam/).
RUNNERS = ("DirectRunner", "direct", "dask", "DataflowRunner", "FlinkRunner", "SparkRunner", "PortableRunner")


def _default_workers() -> int:
    return max(1, os.cpu_count() or 1)


# Sane ranges: far beyond any real image or shard, far below where byte counts overflow.
MAX_MEGAPIXELS_LIMIT = 100_000.0
MAX_FILE_MB_LIMIT = 1_000_000.0  # 1 TB
MIN_SHARD_MB, MAX_SHARD_MB = 0.001, 1_000_000.0


@dataclasses.dataclass
class PrepareConfig:
    """Ingest an image corpus into validated, de-duplicated Arrow IPC shards."""

    input: list[str] = dataclasses.field(
        default_factory=list,
        metadata={"help": "source to ingest: image folder tree, tar archive(s), CSV/JSONL/Parquet manifest or "
                          "shard set, on any fsspec URL; repeat for several"},
    )
    output: str = dataclasses.field(default="", metadata={"recipe": False, "help": "output shard set directory (local or fsspec URL)"})
    size: int = dataclasses.field(
        default=384, metadata={"help": "resize the shorter side to this many pixels (the paper fine-tunes at 384)"}
    )
    max_long_side: int | None = dataclasses.field(
        default=None, metadata={"help": "optional cap on the longer side after resizing (panoramas)"}
    )
    upscale: bool = dataclasses.field(default=False, metadata={"help": "also enlarge images smaller than --size"})
    quality: int = dataclasses.field(default=90, metadata={"help": "JPEG quality of the stored images"})
    store: Literal["jpeg", "raw"] = dataclasses.field(
        default="jpeg", metadata={"help": "store re-encoded JPEG, or raw uint8 HxWx3 pixels (larger, no decode cost)"}
    )
    workers: int = dataclasses.field(
        default_factory=_default_workers,
        metadata={"recipe": False, "help": "DirectRunner worker processes (1 runs in-process: fast start for small corpora), or the "
                          "worker processes of the local Dask cluster --runner dask starts"},
    )
    test_set: list[str] = dataclasses.field(
        default_factory=list,
        metadata={"help": "NAME=SRC: drop corpus images that duplicate an image of this downstream test set "
                          "(paper Sec. 4.1, after BiT); repeat for several"},
    )
    max_megapixels: float = dataclasses.field(
        default=DEFAULT_MAX_MEGAPIXELS, metadata={"help": "quarantine images above this many megapixels (bombs)"}
    )
    max_file_mb: float = dataclasses.field(
        default=DEFAULT_MAX_FILE_MB,
        metadata={"help": "quarantine files (and tar members) larger than this many MB without reading them whole"},
    )
    min_short_side: int = dataclasses.field(
        default=32, metadata={"help": "quarantine images whose shorter side is below this many pixels"}
    )
    shard_mb: float = dataclasses.field(default=256.0, metadata={"help": "target shard size in MB"})
    allowed_roots: list[str] = dataclasses.field(
        default_factory=list,
        metadata={"help": "read corpus items only under these folders or URL prefixes (repeat for several): manifest "
                          "rows, symlinks and archives elsewhere are quarantined as outside_allowed_roots. Without it a "
                          "manifest can name any file this job can read; set it when ingesting manifests you did "
                          "not write"},
    )
    label_map: str | None = dataclasses.field(
        default=None,
        metadata={"help": "class names in id order, one a line (or JSON: a list of names, or name -> id); an integer "
                          "label that is not a name in it is the id of one; items with other labels are quarantined. "
                          "Default: the names seen, sorted (integers by value), or a Parquet file's ClassLabel names"},
    )
    # -- how a source is read: its format, and what its files leave unsaid --
    format: str = dataclasses.field(
        default="auto",
        metadata={"help": "how to read every --input: auto (decided from its content, and said in one line), or "
                          "one of the readers: folder, tar, webdataset, hf_parquet, imagenet, manifest, shard_set, files"},
    )
    label_key: str | None = dataclasses.field(
        default=None,
        metadata={"help": "where a sample's label is: the .json field of a WebDataset sample (default: its .cls, else "
                          "the field 'label'), or the label column of a Hugging Face Parquet file (default 'label')"},
    )
    split: str | None = dataclasses.field(
        default=None,
        metadata={"help": "the split to read from a WebDataset folder with an _info.json, or a Hugging Face Parquet "
                          "folder holding train-*.parquet and validation-*.parquet"},
    )
    labels: str | None = dataclasses.field(
        default=None,
        metadata={"help": "label file for a flat folder of images (ImageNet's validation set): LOC_val_solution.csv "
                          "(ImageId,PredictionString), or the devkit's ground-truth file of ids with --synsets"},
    )
    synsets: str | None = dataclasses.field(
        default=None,
        metadata={"help": "with a ground-truth --labels file: the WNIDs in id order, the devkit's meta.mat or a "
                          "text file of one WNID a line"},
    )
    runner: str = dataclasses.field(
        default="DirectRunner",
        metadata={"recipe": False, "help": "Beam runner: DirectRunner (this machine), dask (a dask.distributed cluster; tested), "
                          "DataflowRunner, FlinkRunner, SparkRunner or PortableRunner (documented, untested here)"},
    )
    dask_address: str | None = dataclasses.field(
        default=None,
        metadata={"recipe": False, "help": "with --runner dask: the scheduler to join, tcp://HOST:PORT; without it the job starts "
                          "a local cluster of --workers processes on 127.0.0.1 and stops it at the end"},
    )
    beam_options: list[str] = dataclasses.field(
        default_factory=list,
        metadata={"recipe": False, "help": "extra Beam pipeline options, e.g. --project=p; see infra/beam/*.yaml"},
    )
    isolate_decoder: bool = dataclasses.field(
        default=False,
        metadata={"recipe": False, "help": "decode in a subprocess so a crash in a native decoder becomes a quarantine record "
                          "instead of a dead worker (slower)"},
    )
    parent_run_id: str | None = dataclasses.field(default=None, metadata={"recipe": False, "help": "MLflow run to nest under"})
    overwrite: bool = dataclasses.field(
        default=False,
        metadata={"recipe": False, "help": "replace a shard set of other inputs already in --output (its dedup files "
                                           "go with it)"},
    )

    def __post_init__(self) -> None:
        check(len(self.input) > 0, "input", "at least one --input source is required")
        check(all(isinstance(s, str) and s.strip() for s in self.input), "input", "sources must be non-empty strings")
        check(bool(self.output.strip()), "output", "an --output directory is required")
        check(self.size >= 1, "size", f"must be a positive number of pixels, got {self.size}")
        check(
            self.max_long_side is None or self.max_long_side >= self.size,
            "max_long_side",
            f"must be at least --size ({self.size}), got {self.max_long_side}",
        )
        check(1 <= self.quality <= 100, "quality", f"JPEG quality must be in 1..100, got {self.quality}")
        check(self.workers >= 1, "workers", f"must be at least 1, got {self.workers}")
        # Upper and lower bounds, not only signs: max_file_mb=1e308 and shard_mb=1e-320 pass "> 0"
        # and overflow to inf in byte counts, after the old manifest is gone.
        check(0 < self.max_megapixels <= MAX_MEGAPIXELS_LIMIT, "max_megapixels",
              f"must be in (0, {MAX_MEGAPIXELS_LIMIT:g}], got {self.max_megapixels}")
        check(0 < self.max_file_mb <= MAX_FILE_MB_LIMIT, "max_file_mb",
              f"must be in (0, {MAX_FILE_MB_LIMIT:g}] MB, got {self.max_file_mb}")
        check(self.min_short_side >= 0, "min_short_side", f"must be >= 0, got {self.min_short_side}")
        check(MIN_SHARD_MB <= self.shard_mb <= MAX_SHARD_MB, "shard_mb",
              f"must be in [{MIN_SHARD_MB:g}, {MAX_SHARD_MB:g}] MB, got {self.shard_mb}")
        self.test_sets()
        check(self.runner in RUNNERS, "runner",
              f"{self.runner!r} is not a runner prepare knows; use one of {', '.join(RUNNERS)}")
        check(self.dask_address is None or self.runner == "dask", "dask_address", "needs --runner dask")
        check(self.dask_address is None or "://" in self.dask_address, "dask_address",
              f"{self.dask_address!r}: expected a scheduler address like tcp://10.0.0.5:8786")
        check(not (self.runner == "dask" and self.isolate_decoder), "isolate_decoder",
              "is not supported with --runner dask: it needs Beam's dead-letter output, which Beam's DaskRunner "
              "routes wrongly (pipelines/dask_runner.py); leave it off or use the DirectRunner")
        self.check_format()
        check(self.synsets is None or self.labels is not None, "synsets",
              "names the ids of a ground-truth file; pass that file with --labels")
        for root in self.allowed_roots:
            check(isinstance(root, str) and bool(root.strip()) and not root.startswith("-"), "allowed_roots",
                  f"{root!r}: expected a folder or URL prefix")
        for opt in self.beam_options:
            check(opt.startswith("--"), "beam_options", f"{opt!r}: expected --name=value")

    def check_format(self) -> None:
        from pipelines.sources import READERS

        check(self.format == "auto" or self.format.replace("-", "_") in READERS, "format",
              f"{self.format!r} is not a format prepare reads; use auto or one of {', '.join(READERS)}")
        for name in ("label_key", "split"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, str) and bool(value.strip())), name, "must not be empty")

    def plan_options(self):
        """What ``--label-key`` and ``--split`` tell the readers (:class:`pipelines.sources.PlanOptions`)."""
        from pipelines.sources import PlanOptions

        return PlanOptions(label_key=self.label_key, split=self.split)

    def roots(self) -> tuple[str, ...] | None:
        """``allowed_roots`` normalised for :func:`common.fs.within_roots`, or None (no restriction)."""
        return tuple(normalize_root(r) for r in self.allowed_roots) if self.allowed_roots else None

    def test_sets(self) -> dict[str, str]:
        """``--test-set`` as an ordered mapping name -> source."""
        return parse_test_sets(self.test_set)
