"""The ``prepare`` Beam pipeline: sources -> decode/validate -> de-duplicate -> Arrow IPC shards.

Graph (every arrow is a PCollection)::

    units --read--> items --process--> records ----test sets----> kept --spill--> --shuffle by content--> shards
                      | rejected          | rejected                   | duplicates              | corpus duplicates
                      +---------------->  quarantine                   +---> duplicates.jsonl <--+

Each step has a single output whose elements say what they are (an item, or a row whose
``_t`` is record, rejected, duplicate or shard), and ``Filter`` splits them: no tagged
outputs, which Beam's DaskRunner routes wrongly (:mod:`pipelines.dask_runner`). An
exception on one element is caught there and becomes a rejected row with reason
``unexpected_error`` (the dead letter).

Only a short reference per record crosses the shuffle: the spill step parks each
image and the record's other fields in per-bundle files under the run's staging
folder and passes on the key, the content hash and where the rest is, which the
shard writer reads back (:mod:`pipelines.spill`): the runner holds the whole
shuffle at once, so what crosses it is paid per input in memory. A row's shard
is a stable hash of its content hash, so exact copies of one image meet in the
same shard group, and the shard writer keeps one of them (the smallest key)
while writing.

Counts are reconciled from the pipeline's outputs (quarantine rows, duplicate
rows, shard row counts) against an independent count of the items read, never
from counters alone: counters may double-count retried bundles. The job
refuses to write a manifest when ``inputs != written + rejected + duplicates``.

Output is atomic at two levels: each shard is written as
``shard-NNNNN.arrow.tmp-<uuid>`` under the run's staging folder then renamed,
and ``manifest.json`` (written last) is what makes a shard set visible to
:class:`pipelines.schema.ShardSet`. One run writes to a folder at a time, and a
set already there stays readable until the new one replaces it at the end
(:mod:`pipelines.output`); the next run removes a killed run's leftovers.

Sharding is deterministic without a global sort: the number of shards is the
total encoded size over ``shard_mb``, a row's shard is a stable hash of its
content hash (a uniform hash already), and rows are sorted by key inside each
shard. The same inputs therefore give byte-identical shards.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import re
import signal
import time
import traceback
import uuid
from typing import Any, Iterable, Iterator, Mapping

import fsspec
import pyarrow as pa
import pyarrow.ipc as ipc

from common import config as vconfig
from common import tracking
from common.cli import Interrupted, interrupts
from common.config import InputError
from common.fs import atomic_open, atomic_write
from common.fs import url_to_fs as _fs
from common.jobenv import durable_path
from common.progress import TTY_EVERY, IngestProgress, ProgressLine, Ticker
from neardup.signatures import SIGNATURE_VERSION
from pipelines import direct_runner, glibc, schema, worker_counts
from pipelines.config import PrepareConfig
from pipelines.output import OutputFolder
from pipelines.process import ProcessOptions, process_item, reject
from pipelines.sources import SourceError, Unit, expand, plan

log = logging.getLogger(__name__)

NAMESPACE = "prepare"
# Per-row bytes beyond the image (key, hashes, labels, offsets) when sizing shards.
_ROW_OVERHEAD = 160


#: Units per plan chunk (pipelines.ingest.write_plan), and the fewest chunks a large plan is cut into.
UNITS_PER_CHUNK, MIN_PLAN_CHUNKS = 256, 64

#: Runs of the whole pipeline before an accounting mismatch is an error (see run_prepare).
MAX_ATTEMPTS = 2


class AccountingError(RuntimeError):
    """``inputs != written + rejected + duplicates``: an item was lost or counted twice."""


class PrepareError(InputError):
    """A usage error found before the pipeline starts (missing input, bad label map, output inside an input)."""


class _Digest:
    """A write-only file that passes bytes on and keeps their sha256 and count."""

    def __init__(self, f):
        self._f, self.sha256, self.size, self.closed = f, hashlib.sha256(), 0, False

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self._f.write(data)

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:  # the IPC writer closes its sink; the real file is closed by atomic_open
        self.closed = True


def _jsonl(rows: Iterable[Mapping[str, Any]]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()


# -- label map ---------------------------------------------------------------------------------

def load_label_map(path: str) -> dict[str, int]:
    """A label map file: JSON ``{"name": id}``, a JSON list of names, or a text file of one name per line."""
    try:
        with fsspec.open(path, "rt") as f:
            text = f.read()
    except FileNotFoundError:
        raise PrepareError(f"label_map: {path} not found; pass a JSON {{name: id}} file or a names list") from None
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PrepareError(f"label_map: {path} is not valid JSON ({exc})") from None
    else:
        data = [line.strip() for line in text.splitlines() if line.strip()]
    if isinstance(data, list):
        data = {str(name): i for i, name in enumerate(data)}
    if not isinstance(data, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in data.values()):
        raise PrepareError(f"label_map: {path} must map label names to non-negative integer ids")
    if len(set(data.values())) != len(data):
        raise PrepareError(f"label_map: {path} gives the same id to several names")
    return {str(k): int(v) for k, v in data.items()}


# -- pipeline steps (module-level so they pickle by reference) ---------------------------------

def _read_unit(unit: Unit, max_bytes: int | None = None, progress_dir: str | None = None,
               allowed_roots: tuple[str, ...] | None = None) -> Iterator[Any]:
    """A unit's items, one at a time, then a quarantine row for the rest if reading it fails.

    Streamed: only the item being handed on is held, so memory follows one file of at
    most ``max_file_mb``, whatever the unit's size (a whole tar, 16 files). An item already
    handed on stays counted; a failure adds one row for the unread rest, so each input is
    counted once.
    """
    from apache_beam.metrics import Metrics

    inputs = Metrics.counter(NAMESPACE, "inputs")
    n = 0
    try:
        # Files come with a reader (their bytes are read by the step that decodes them), archive
        # members with their bytes: either way one item's bytes at a time.
        for item in expand(unit, max_bytes=max_bytes, allowed_roots=allowed_roots):
            n += 1
            inputs.inc()
            worker_counts.count(progress_dir, inputs=1)
            yield item
    except Exception as exc:  # noqa: BLE001 - any failure of one source becomes its quarantine row
        worker_counts.count(progress_dir, units=1, inputs=1, processed=1, rejected=1)
        inputs.inc()
        yield _unit_failed(unit, exc, n)
        return
    worker_counts.count(progress_dir, units=1)


def write_plan(units: list[Unit], url: str) -> list[str]:
    """Write ``units`` as JSON-lines chunk files under ``url``; returns their paths.

    The pipeline reads its units from these files, so neither its graph (which every Beam
    worker receives whole) nor the driver holds the plan while the job runs: at 80,000
    inputs that was 1.5 KB per input in the driver (benchmarks/README.md, issue 24). Enough
    chunks that every worker gets some; one unit each for a small corpus, as before.
    """
    fs, root = _fs(url)
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


def _plan_chunk(path: bytes) -> Iterator[Unit]:
    fs, p = _fs(path.decode("utf-8", "surrogateescape"))
    with fs.open(p, "rt") as f:
        for line in f:
            d = json.loads(line)
            yield Unit(d["kind"], tuple(d["uris"]), tuple(tuple(x) for x in d["labels"]), d["index"],
                       tuple(d["error"]) if d["error"] else None)


def _unit_failed(unit: Unit, exc: BaseException, done: int = 0) -> dict[str, Any]:
    after = f" after {done} item(s); the rest of it is skipped" if done else ""
    return reject(unit.uris[0], "unexpected_error", f"{unit.uris[0]}: reading the source failed{after}: {exc!r}")


def _process(item, opts: ProcessOptions, progress_dir: str | None = None) -> dict[str, Any]:
    """:func:`process_item`, with any exception it raises turned into an ``unexpected_error`` row (dead letter)."""
    try:
        row = process_item(item, opts)
    except Exception as exc:  # noqa: BLE001 - one bad item must not fail the job
        uri = getattr(item, "uri", repr(item)[:200])
        log.warning("unexpected error on %s: %s", uri, "".join(traceback.format_exception(exc)[-3:]))
        row = reject(uri, "unexpected_error", f"{uri}: {exc!r}")
    worker_counts.count(progress_dir, processed=1, rejected=int(_is(row, "rejected")))
    return row


def _item_crashed(bad, progress_dir: str | None = None) -> dict[str, Any]:
    """A dead-letter element of ``--isolate-decoder``'s subprocess: the decoder crashed the process."""
    item, (exc_type, exc_repr, tb) = bad
    uri = getattr(item, "uri", repr(item)[:200])
    worker_counts.count(progress_dir, processed=1, rejected=1)
    return reject(uri, "unexpected_error", f"{uri}: {exc_repr}")


def _kind(row) -> str:
    """What a pipeline element is: a source item, or a row's ``_t`` (record, rejected, duplicate, shard)."""
    return row["_t"] if isinstance(row, dict) else "item"


def _is(row, kind: str) -> bool:
    return _kind(row) == kind


def _split(pcoll, name: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    """``pcoll`` split by kind, one ``Filter`` each: the same on every runner, unlike tagged outputs.

    Beam's DaskRunner hands every tagged output of a ParDo (``with_outputs``, ``Partition``,
    ``with_exception_handling``) all of the ParDo's elements (pipelines/dask_runner.py).
    """
    import apache_beam as beam

    return {kind: pcoll | f"{name}{kind.capitalize()}" >> beam.Filter(_is, kind) for kind in kinds}


def _count(name: str):
    def fn(row):
        from apache_beam.metrics import Metrics

        suffix = row.get("reason") or row.get("cause") or ""
        Metrics.counter(NAMESPACE, f"{name}.{suffix}" if suffix else name).inc()
        return row

    return fn


def _match_test_sets(record: dict, index, progress_dir: str | None = None) -> dict:
    matches = index.match(record["content_hash"], record["phash"])
    if not matches:
        return record
    worker_counts.count(progress_dir, duplicates=1)
    m = matches[0]  # closest first; an item is counted against one test set only
    return {
        "_t": "duplicate", "key": record["key"], "uri": record["uri"], "cause": m.test_set,
        "test_set": m.test_set, "test_key": m.key, "test_uri": m.uri, "distance": int(m.distance),
        "exact": bool(m.exact), "direction": m.direction,
    }


def _pick_unique(records: Iterable) -> tuple[list, list[tuple]]:
    """(kept, [(dropped, kept copy)]): one record per content hash, the one with the smallest key."""
    by_hash: dict[str, list] = {}
    for r in records:
        by_hash.setdefault(r.content_hash, []).append(r)
    kept, dropped = [], []
    for copies in by_hash.values():
        copies.sort(key=lambda r: r.key)
        kept.append(copies[0])
        dropped += [(r, copies[0]) for r in copies[1:]]
    return kept, dropped


def _num_shards(total_bytes: int, shard_bytes: float) -> int:
    return max(1, math.ceil(total_bytes / shard_bytes))


def shard_of(content_hash: str, num_shards: int) -> int:
    """The shard of a record: by content, so exact duplicates meet in one shard group."""
    return int(content_hash[:8], 16) % num_shards


def _write_shard(group, out_url: str, staging_url: str, label_map: Mapping[str, int],
                 progress_dir: str | None = None) -> Iterator[dict]:
    """Write one shard atomically, keeping one record per content hash.

    The group holds packed :class:`pipelines.spill.Ref` strings; each record's image and
    fields are read back from the run's spill files one output batch at a time.
    Yields the shard's manifest entry, then a duplicate row for each record dropped.
    """
    from apache_beam.metrics import Metrics

    from pipelines.spill import Blobs, Ref  # loads apache_beam

    index, packed = group
    kept, dropped = _pick_unique(Ref.unpack(r) for r in packed)
    kept.sort(key=lambda r: r.key)
    name = schema.shard_name(index)
    fs, root = _fs(out_url)
    # Streamed in batches: besides the refs, only one batch of rows is ever held
    # as Arrow arrays, and the file's bytes are never held whole.
    with atomic_open(f"{root}/{name}", fs) as f, Blobs(staging_url) as blobs:
        sink = _Digest(f)
        with ipc.new_file(pa.PythonFile(sink, mode="w"), schema.SCHEMA) as writer:
            for start in range(0, len(kept), schema.BATCH_ROWS):
                rows = [{
                    schema.KEY: r["key"], schema.IMAGE: image, schema.FORMAT: r["format"],
                    schema.HEIGHT: r["height"], schema.WIDTH: r["width"],
                    schema.LABELS: sorted({label_map[label] for label in r["labels"]}),
                    schema.SOURCE: r["uri"], schema.CONTENT_HASH: r["content_hash"], schema.PHASH: r["phash"],
                } for image, r in blobs.read_records(kept[start:start + schema.BATCH_ROWS])]
                writer.write_table(schema.records_to_table(rows))
                # Arrow's allocator (mimalloc) otherwise keeps what each batch freed: a worker
                # held about a shard's size more after writing one, and more again after the next.
                pa.default_memory_pool().release_unused()
        uris = [r["uri"] for _, r in blobs.read_records([d for d, _ in dropped])]
    Metrics.counter(NAMESPACE, "written").inc(len(kept))
    Metrics.counter(NAMESPACE, "bytes_written").inc(sink.size)
    worker_counts.count(progress_dir, written=len(kept), duplicates=len(dropped))
    yield {"_t": "shard", "path": name, "rows": len(kept), "bytes": sink.size, "sha256": sink.sha256.hexdigest(),
           "received": len(kept) + len(dropped)}
    for (d, keep), uri in zip(dropped, uris):
        yield {"_t": "duplicate", "key": d.key, "uri": uri, "cause": "corpus", "duplicate_of": keep.key}


def _write_outputs(rows: list[dict], url: str) -> None:
    # Small rows only (counts, quarantine, duplicates, shard entries), so one
    # file written through fsspec: any filesystem the shards can go to.
    fs, path = _fs(url)
    atomic_write(path, _jsonl(rows), fs)


def _direct(cfg: PrepareConfig) -> bool:
    return cfg.runner in ("DirectRunner", "direct")


def _in_process(cfg: PrepareConfig) -> bool:
    """Whether every step runs in this process: the DirectRunner's in-memory mode (``--workers 1``)."""
    return _direct(cfg) and cfg.workers == 1


def _dask(cfg: PrepareConfig) -> bool:
    return cfg.runner == "dask"


def pipeline_options(cfg: PrepareConfig, *, dask_address: str | None = None, partitions: int | None = None):
    """Beam options for ``cfg``; on Dask, ``dask_address`` is the scheduler and ``partitions`` the plan's chunks."""
    from apache_beam.options.pipeline_options import PipelineOptions

    if _dask(cfg):
        from pipelines import dask_runner

        flags = [f"--runner={dask_runner.RUNNER}", f"--dask_client_address={dask_address or cfg.dask_address}"]
        if partitions:
            # One Dask partition per plan chunk (one source unit each for a small corpus): Beam's
            # default packs up to 128 elements per partition, which would give a small corpus one task.
            flags.append(f"--dask_npartitions={partitions}")
        return PipelineOptions(flags + list(cfg.beam_options))
    flags = [f"--runner={cfg.runner}"]
    if _direct(cfg):
        # One worker runs in-process: the multi-process mode costs seconds of
        # start-up that a few hundred images do not repay.
        mode = "in_memory" if _in_process(cfg) else "multi_processing"
        flags += [f"--direct_num_workers={cfg.workers}", f"--direct_running_mode={mode}"]
        if not _in_process(cfg):
            direct_runner.flush_by_size_only()  # Beam's periodic flush drops elements (direct_runner)
        if not _in_process(cfg) and not any(o.startswith("--environment_type") for o in cfg.beam_options):
            # Local worker processes: serve them on loopback only, and keep their
            # start-up chatter off the terminal (a user's own flags come later and win).
            direct_runner.bind_servers_to_loopback()
            direct_runner.workers_in_own_session()
            flags += direct_runner.QUIET_WORKER_FLAGS
    return PipelineOptions(flags + list(cfg.beam_options))


def _count_row(pcolls: tuple, name: str, tag: str):
    """A one-element PCollection ``{"_t": tag, "n": elements in pcolls}``.

    Counted as ones, never by flattening the elements themselves: a Flatten fed by the
    items would make the runner materialise every image's bytes a second time (on the
    DirectRunner that doubled the wall time and tripled the memory).
    """
    import apache_beam as beam

    ones = tuple(pc | f"{name}One{i}" >> beam.Map(lambda _: 1) for i, pc in enumerate(pcolls))
    return (
        ones
        | f"All{name}" >> beam.Flatten()
        | f"Count{name}" >> beam.CombineGlobally(sum)
        | f"{name}Row" >> beam.Map(lambda n: {"_t": tag, "n": n})
    )


def build_pipeline(p, plan: list[str], cfg: PrepareConfig, label_map: Mapping[str, int] | None,
                   index, out_url: str, staging_url: str, progress_dir: str | None = None) -> None:
    """Add the ingest to pipeline ``p``; all small outputs go as JSON lines under ``staging_url``.

    ``plan`` holds the paths of the unit chunks :func:`write_plan` wrote.

    Workers add their counts to ``progress_dir`` as they go (:mod:`pipelines.worker_counts`).
    """
    import apache_beam as beam
    from apache_beam.pvalue import AsSingleton

    opts = ProcessOptions.from_config(cfg, label_map)
    shard_bytes = cfg.shard_mb * 1e6

    # Every step has one output; its elements say what they are (an item, a record, a rejected,
    # duplicate or shard row) and Filters split them. Failures are caught per element into
    # rejected rows (reason unexpected_error: the dead letter), never routed by tagged outputs.
    max_bytes = int(cfg.max_file_mb * 1e6)
    # As bytes: an output folder's name need not be UTF-8, which Beam's str coder requires.
    chunks = [path.encode("utf-8", "surrogateescape") for path in plan]
    units = p | "Plan" >> beam.Create(chunks) | "Units" >> beam.FlatMap(_plan_chunk)
    read = units | "Read" >> beam.FlatMap(_read_unit, max_bytes, progress_dir, cfg.roots())
    inputs = _count_row((read,), "Inputs", "inputs")
    read_kinds = _split(read, "Read", ("item", "rejected"))

    if cfg.isolate_decoder:
        # A crash of a native decoder kills the process, so no except clause sees it: Beam's
        # subprocess dead letter does. Tagged outputs again, so config refuses this on Dask.
        isolated = read_kinds["item"] | "Process" >> beam.Map(_process, opts, progress_dir).with_exception_handling(
            use_subprocess=True
        )
        crashed = isolated["bad"] | "ItemCrashed" >> beam.Map(_item_crashed, progress_dir)
        processed = (isolated["good"], crashed) | "AllProcessed" >> beam.Flatten()
    else:
        processed = read_kinds["item"] | "Process" >> beam.Map(_process, opts, progress_dir)
    processed_kinds = _split(processed, "Processed", ("record", "rejected"))
    records = processed_kinds["record"]

    dup_parts = []
    if index is not None:
        index_side = AsSingleton(p | "TestSetIndex" >> beam.Create([index]))
        matched = records | "MatchTestSets" >> beam.Map(_match_test_sets, index_side, progress_dir)
        matched_kinds = _split(matched, "Matched", ("record", "duplicate"))
        records = matched_kinds["record"]
        dup_parts.append(matched_kinds["duplicate"])

    # From here on only a packed Ref per record travels: its image and fields wait in staging
    # files (pipelines/spill.py), since the runner holds everything in the shuffle at once.
    from pipelines.spill import Ref, SpillRecords

    if label_map is not None:
        labels_pc = p | "GivenLabels" >> beam.Create([dict(label_map)])
    else:
        # Names from every record that reaches the shards, dropped corpus duplicates included:
        # the label map must exist before the shard writers run.
        labels_pc = (
            records
            | "LabelNames" >> beam.FlatMap(lambda r: r["labels"])
            | "DistinctLabels" >> beam.Distinct()
            | "SortLabels" >> beam.combiners.ToList()
            | "LabelIds" >> beam.Map(lambda names: {n: i for i, n in enumerate(sorted(names))})
        )
    refs = records | "SpillRecords" >> beam.ParDo(SpillRecords(staging_url))
    # Counted again where the records enter the shuffle, so that a mismatch in the
    # accounting says on which side of it items went missing.
    to_shards = _count_row((refs,), "Records", "records")
    num_shards = (
        refs
        | "RowBytes" >> beam.Map(lambda r: Ref.unpack(r).blob[2] + _ROW_OVERHEAD)
        | "TotalBytes" >> beam.CombineGlobally(sum)
        | "NumShards" >> beam.Map(_num_shards, shard_bytes)
    )
    written = (
        refs
        | "AssignShard" >> beam.Map(lambda r, n: (shard_of(Ref.unpack(r).content_hash, n), r), AsSingleton(num_shards))
        | "GroupShard" >> beam.GroupByKey()
        | "WriteShard" >> beam.FlatMap(_write_shard, out_url, staging_url, AsSingleton(labels_pc),
                                                progress_dir)
    )
    written_kinds = _split(written, "Written", ("shard", "duplicate"))
    shards = written_kinds["shard"]
    dup_parts.append(written_kinds["duplicate"])

    all_rejected = (read_kinds["rejected"], processed_kinds["rejected"]) | "AllRejected" >> beam.Flatten() | "CountRejected" >> beam.Map(_count("rejected"))
    all_dups = tuple(dup_parts) | "AllDuplicates" >> beam.Flatten() | "CountDuplicates" >> beam.Map(_count("duplicates"))
    label_rows = labels_pc | "LabelsRow" >> beam.Map(lambda m: {"_t": "label_map", "map": m})
    # Last, and fed by every step: Beam's DaskRunner computes only the last step's graph.
    (
        (inputs, all_rejected, all_dups, shards, label_rows, to_shards)
        | "AllOutputs" >> beam.Flatten()
        | "CollectOutputs" >> beam.combiners.ToList()
        | "WriteOutputs" >> beam.Map(_write_outputs, f"{staging_url}/outputs.jsonl")
    )


# -- the driver -------------------------------------------------------------------------------

def _clean_leftovers(fs, root: str) -> None:
    """Remove what a killed run may have left: temporary shard files and staging folders."""
    for path in fs.ls(root, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if schema.TMP_MARKER in name:
            fs.rm(path)
        elif name.startswith(".staging-"):
            fs.rm(path, recursive=True)


def _read_staging(fs, staging: str) -> list[dict]:
    rows = []
    for path in sorted(fs.glob(f"{staging}/outputs*")):
        with fs.open(path, "rt") as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return rows


def _inside(child: str, parent: str) -> bool:
    fc, pc = _fs(child)
    fp, pp = _fs(parent)
    c, p = fc.unstrip_protocol(pc), fp.unstrip_protocol(pp)
    return c == p or c.startswith(p.rstrip("/") + "/")


def _check_process_local(cfg: PrepareConfig) -> None:
    """``memory://`` lives in one process: Beam workers elsewhere would read and write empty copies.

    Test sets may stay there: their index is built here, in the driver, and shipped to the workers.
    """
    if _in_process(cfg):
        return
    for what, url in [("output", cfg.output), *(("input", u) for u in cfg.input)]:
        if str(url).startswith("memory://"):
            if not _direct(cfg):
                raise PrepareError(
                    f"{what} {url}: memory:// exists only inside this process, but --runner {cfg.runner} runs the "
                    "work in other processes; use a filesystem every worker shares (a mount or an object store URL)"
                )
            raise PrepareError(
                f"{what} {url}: memory:// exists only inside this process, but the {cfg.runner} with "
                f"--workers {cfg.workers} runs the work in other processes; use --workers 1 or a shared filesystem"
            )


def plan_inputs(cfg: PrepareConfig) -> list[Unit]:
    _check_process_local(cfg)
    for src in cfg.input:
        if _inside(cfg.output, src):
            raise PrepareError(
                f"output {cfg.output} is inside input {src}; write the shard set to a separate directory"
            )
    units: list[Unit] = []
    for src in cfg.input:
        try:
            found = plan(src)
        except SourceError as exc:
            raise PrepareError(f"input: {exc}") from None
        if not found:
            # An empty shard set would only fail later, in pre-training, far from the cause.
            raise PrepareError(
                f"input: {src}: nothing to ingest (no files, manifest rows or shards; hidden files are skipped); "
                "check the path"
            )
        units.extend(found)
    return units


def _check_dask(cfg: PrepareConfig) -> int | None:
    """With ``--dask-address``: the number of workers its scheduler has, or a PrepareError if none answers."""
    if not _dask(cfg):
        return None
    try:
        from pipelines import dask_runner
    except ImportError as exc:
        raise PrepareError(
            f"--runner dask needs dask.distributed ({exc}); install the extra: pip install -c constraints.txt '.[dask]'"
        ) from None
    try:
        if cfg.dask_address is None:
            return cfg.workers
        timeout = next((float(o.split("=", 1)[1]) for o in cfg.beam_options
                        if o.startswith("--dask_connection_timeout=")), dask_runner.CONNECT_TIMEOUT_S)
        workers = dask_runner.connect(cfg.dask_address, timeout)
    except dask_runner.DaskUnavailable as exc:
        raise PrepareError(str(exc)) from None
    if workers == 0:
        log.warning("prepare: the Dask scheduler at %s has no workers yet; the job waits for them", cfg.dask_address)
    return workers


@dataclasses.dataclass
class _Engine:
    address: str | None  # the Dask scheduler, when the runner is dask
    workers: int  # worker processes, for the per-worker rate
    startup_s: float  # starting a local cluster, if one was started


@contextlib.contextmanager
def _engine(cfg: PrepareConfig, cluster_workers: int | None) -> Iterator[_Engine]:
    """Where the pipeline runs: for ``--runner dask`` without an address, a local cluster for the job's length."""
    t0 = time.perf_counter()
    if _dask(cfg) and cfg.dask_address is None:
        from pipelines import dask_runner

        with dask_runner.local_cluster(cfg.workers) as address:
            yield _Engine(address, cfg.workers, time.perf_counter() - t0)
        return
    yield _Engine(cfg.dask_address, cluster_workers or cfg.workers, 0.0)


def run_prepare(cfg: PrepareConfig) -> dict:
    """Run the ingest described by ``cfg`` and return the manifest (also written to ``cfg.output``).

    Raises:
        PrepareError: a missing input, bad label map or unusable output, before anything is written.
        AccountingError: the counts do not reconcile; no manifest is written.
    """
    import apache_beam as beam

    from pipelines.testsets import check_sources

    units = plan_inputs(cfg)
    cluster_workers = _check_dask(cfg)
    label_map = load_label_map(cfg.label_map) if cfg.label_map else None
    test_sets = cfg.test_sets()
    check_sources(test_sets)

    try:
        cfg = dataclasses.replace(cfg, output=durable_path(cfg.output, "output"))
        tracking.tracking_uri()
    except InputError as exc:  # a result that would vanish with Ray's uploaded working dir
        raise PrepareError(str(exc)) from None
    fs, root = _fs(cfg.output)
    try:
        fs.makedirs(root, exist_ok=True)
    except OSError as exc:
        raise PrepareError(f"output: cannot create {cfg.output} ({exc}); pass a writable directory") from None
    out_url = fs.unstrip_protocol(root)

    params = vconfig.to_dict(cfg)
    # One writer per folder; the set already there stays readable until swap() (pipelines/output.py).
    with OutputFolder(cfg.output, cfg.input, overwrite=cfg.overwrite) as folder, \
            _engine(cfg, cluster_workers) as engine, \
            tracking.start_run("prepare", params=params, parent_run_id=cfg.parent_run_id,
                               run_name=f"prepare {_set_name(cfg.output)}", tags=tracking.run_tags(cfg)) as run:
        _clean_leftovers(fs, root)
        plan_dir = f"{root}/.staging-plan-{uuid.uuid4().hex}"
        plan = write_plan(units, fs.unstrip_protocol(plan_dir))
        n_units, known = len(units), worker_counts.known_inputs(units)
        del units
        index = None
        if test_sets:
            from pipelines.testsets import build_test_set_index

            t_index = time.perf_counter()
            index = build_test_set_index(test_sets, max_bytes=int(cfg.max_file_mb * 1e6),
                                         allowed_roots=cfg.roots())
            tracking.log_metrics({"test_set_index_s": time.perf_counter() - t_index, "test_set_images": len(index)})

        t0 = time.perf_counter()
        run_cfg = cfg
        for attempt in range(1, MAX_ATTEMPTS + 1):
            staging = f"{root}/.staging-{uuid.uuid4().hex}"
            fs.makedirs(f"{staging}/shards", exist_ok=True)
            options = pipeline_options(run_cfg, dask_address=engine.address, partitions=len(plan))
            channel = worker_counts.channel_dir(staging, fs)
            line = ProgressLine("prepare")
            watch = IngestProgress(line, worker_counts.Totals(channel).poll if channel else None, n_units, known)
            reaper = direct_runner.WorkerReaper()
            try:
                with Ticker(watch.tick, min(TTY_EVERY, line.every) if line.enabled else 60.0), \
                        interrupts(reaper):
                    runner = direct_runner.direct_runner(options) if _direct(run_cfg) else None
                    # The multi-worker driver's buffers go back to the system when freed (issue 24).
                    pinned = (glibc.mmap_threshold_pinned() if _direct(run_cfg) and not _in_process(run_cfg)
                              else contextlib.nullcontext())
                    with pinned, beam.Pipeline(runner=runner, options=options) as p:
                        build_pipeline(p, plan, cfg, label_map, index, fs.unstrip_protocol(f"{staging}/shards"),
                                       fs.unstrip_protocol(staging), channel)
                watch.finish()
            except KeyboardInterrupt as exc:
                tracking.end_active_run("KILLED")
                kept = (f"{cfg.output} keeps the shard set it held before" if folder.old_manifest() is not None
                        else f"no shard set was written to {cfg.output}") + " (the ingest starts over when re-run)"
                raise Interrupted(getattr(exc, "signum", signal.SIGINT), kept) from None
            finally:
                reaper.close()
                worker_counts.close(channel)  # the in-process runner's counts file is this process's
            outputs = _read_staging(fs, staging)
            try:
                manifest, quarantine, duplicates = _summarise(outputs, cfg, label_map, test_sets)
                break
            except AccountingError as exc:
                # Kept for the bug report: the run's artifacts, and the staging folder of the last attempt.
                tracking.log_text(_jsonl(outputs).decode(), f"failed_attempt_{attempt}/outputs.jsonl")
                if attempt == MAX_ATTEMPTS:
                    raise AccountingError(
                        f"{exc}. No manifest was written after {attempt} attempts. This is a bug; please report it "
                        f"with {staging} and the MLflow run {run.info.run_id} (failed_attempt_*/outputs.jsonl)"
                    ) from None
                # Should the DirectRunner's multi-worker streams still lose elements
                # (direct_runner.flush_by_size_only), the in-process runner has none of them; the
                # pipeline is deterministic, so its shards are exactly those of a clean first run.
                if _direct(run_cfg) and not _in_process(run_cfg):
                    run_cfg = dataclasses.replace(run_cfg, workers=1)
                log.warning("prepare: attempt %d: %s; running the pipeline again%s", attempt, exc,
                            " in one process (--workers 1)" if run_cfg is not cfg else "")
                fs.rm(staging, recursive=True)
        wall = time.perf_counter() - t0
        # Beam's DaskRunner reports no metrics (pipelines/dask_runner.py); the counts come from outputs.
        beam_counters = {} if _dask(cfg) else _beam_counters(p)
        manifest["attempts"] = attempt
        manifest["mlflow_run_id"] = run.info.run_id
        manifest["config"] = params

        folder.swap(f"{staging}/shards", manifest,
                    {schema.QUARANTINE: _jsonl(quarantine), schema.DUPLICATES: _jsonl(duplicates)})
        # With it go the temporary files of workers killed while writing a shard (the task ran again elsewhere).
        fs.rm(staging, recursive=True)
        fs.rm(plan_dir, recursive=True)
        written = schema.shard_set_record(out_url)
        tracking.set_tags({tracking.TAG_OUTPUT_MANIFEST: written["manifest_sha256"],
                           tracking.TAG_DEDUP_STATE: written["dedup_state"]})

        counts = manifest["counts"]
        metrics = {
            "inputs": counts["inputs"], "written": counts["written"],
            "rejected": counts["rejected_total"], "duplicates": counts["duplicates_total"],
            "shards": len(manifest["shards"]), "output_mb": sum(s["bytes"] for s in manifest["shards"]) / 1e6,
            "wall_s": wall, "attempts": attempt, "images_per_s": counts["inputs"] / wall if wall > 0 else 0.0,
            "images_per_s_per_worker": counts["inputs"] / wall / max(engine.workers, 1) if wall > 0 else 0.0,
        }
        if _dask(cfg):
            metrics.update({"dask_workers": engine.workers, "dask_startup_s": engine.startup_s})
        metrics.update({f"rejected.{k}": v for k, v in counts["rejected"].items()})
        metrics.update({f"duplicates.{k}": v for k, v in counts["duplicates"].items()})
        metrics.update({f"beam.{k}": v for k, v in beam_counters.items()})
        tracking.log_metrics(metrics)
        if type(fs).__name__ == "LocalFileSystem":
            for name in (schema.MANIFEST, schema.QUARANTINE, schema.DUPLICATES):
                tracking.log_artifact(f"{root}/{name}")
        else:
            tracking.log_dict(manifest, schema.MANIFEST)
            tracking.log_text(_jsonl(quarantine).decode(), schema.QUARANTINE)
            tracking.log_text(_jsonl(duplicates).decode(), schema.DUPLICATES)
    return manifest


def _set_name(output: str) -> str:
    """A shard set's readable name for run names: its folder, with the parent's for a split
    folder (``digits/train800`` rather than ``train800``)."""
    parts = [p for p in str(output).rstrip("/").split("/") if p]
    if len(parts) >= 2 and re.match(r"(train|val|test|dev)", parts[-1]):
        return "/".join(parts[-2:])
    return parts[-1] if parts else str(output)


def _beam_counters(p) -> dict[str, float]:
    try:
        from apache_beam.metrics.metric import MetricsFilter

        result = p.result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))
        out: dict[str, float] = {}
        for c in result["counters"]:
            out[c.key.metric.name] = out.get(c.key.metric.name, 0) + (c.committed or c.attempted or 0)
        return out
    except Exception as exc:  # some runners do not report metrics; the counts come from outputs anyway
        log.warning("Beam metrics unavailable: %s", exc)
        return {}


def _where_lost(outputs: list[dict]) -> str:
    """Which side of the shuffle to the shard writers the accounting broke on, for the error message."""
    sent = sum(r["n"] for r in outputs if r["_t"] == "records")
    received = sum(r.get("received", 0) for r in outputs if r["_t"] == "shard")
    if sent == received:
        return f" before the shuffle ({sent} records reached it and all came out)"
    return (f": {sent} records went into the shuffle to the shard writers and {received} came out of it, "
            "so the runner lost or repeated data between those steps")


def _summarise(outputs: list[dict], cfg: PrepareConfig, label_map, test_sets) -> tuple[dict, list, list]:
    inputs = sum(r["n"] for r in outputs if r["_t"] == "inputs")
    shards = sorted(
        ({k: r[k] for k in ("path", "rows", "bytes", "sha256")} for r in outputs if r["_t"] == "shard"),
        key=lambda s: s["path"],
    )
    quarantine = sorted(
        ({k: r[k] for k in ("uri", "reason", "detail", "key")} for r in outputs if r["_t"] == "rejected"),
        key=lambda r: (r["uri"], r["reason"], r["detail"]),
    )
    duplicates = sorted(
        ({k: v for k, v in r.items() if k != "_t"} for r in outputs if r["_t"] == "duplicate"),
        key=lambda r: (r["key"], r["uri"], r["cause"]),
    )
    maps = [r["map"] for r in outputs if r["_t"] == "label_map"]
    final_map = label_map if label_map is not None else (maps[0] if maps else {})

    rejected: dict[str, int] = {}
    for r in quarantine:
        rejected[r["reason"]] = rejected.get(r["reason"], 0) + 1
    dup_counts = {"corpus": 0, **{name: 0 for name in test_sets}}
    for r in duplicates:
        dup_counts[r["cause"]] = dup_counts.get(r["cause"], 0) + 1
    written = sum(s["rows"] for s in shards)
    counts = {
        "inputs": inputs, "written": written,
        "rejected": dict(sorted(rejected.items())), "rejected_total": sum(rejected.values()),
        "duplicates": dup_counts, "duplicates_total": sum(dup_counts.values()),
    }
    if inputs != written + counts["rejected_total"] + counts["duplicates_total"]:
        raise AccountingError(
            f"{cfg.output}: inputs ({inputs}) != written ({written}) + rejected ({counts['rejected_total']}) "
            f"+ duplicates ({counts['duplicates_total']}); items were lost or double-counted"
            + _where_lost(outputs)
        )
    manifest = {
        "schema_version": schema.SCHEMA_VERSION,
        "format": "arrow-ipc-file",
        "columns": list(schema.COLUMNS),
        "shards": shards,
        "num_rows": written,
        "label_map": dict(sorted(final_map.items(), key=lambda kv: kv[1])),
        "counts": counts,
        "sources": list(cfg.input),
        # dedup.rescan recomputes the phash codes of a set written under another version.
        "signature_version": SIGNATURE_VERSION,
    }
    return manifest, quarantine, duplicates
