"""The ``prepare`` Beam graph: sources -> decode/validate -> de-duplicate -> Arrow IPC shards.

Graph (every arrow is a PCollection)::

    units --read--> items --process--> records ----test sets----> kept --spill--> --shuffle by content--> shards
                      | rejected          | rejected                   | duplicates              | corpus duplicates
                      +---------------->  quarantine                   +---> duplicates.jsonl <--+

:func:`build_pipeline` adds it stage by stage, one function each. Each step has a single output
whose elements say what they are (an item, or a row whose ``_t`` is record, rejected, duplicate
or shard), and ``Filter`` splits them: no tagged outputs, which Beam's DaskRunner routes wrongly
(:mod:`pipelines.dask_runner`). An exception on one element is caught there and becomes a
rejected row with reason ``unexpected_error`` (the dead letter).

Only a short reference per record crosses the shuffle: the spill step parks each image and the
record's other fields in per-bundle files under the run's staging folder and passes on the key,
the content hash and where the rest is (:mod:`pipelines.spill`), since the runner holds the whole
shuffle at once. The shard writer (:mod:`pipelines.shard_writer`) reads them back.

Every small output (counts, quarantine and duplicate rows, shard entries, the label map) ends in
one file, ``outputs.jsonl`` in the staging folder, which :mod:`pipelines.accounting` reconciles.
"""
from __future__ import annotations

import logging
import traceback
from typing import Any, Iterator, Mapping

from pipelines import shard_writer, staging, worker_counts
from pipelines.config import NAMESPACE, PrepareConfig
from pipelines.labels import default_label_map
from pipelines.process import ProcessOptions, process_item, reject
from pipelines.sources import Unit, expand

log = logging.getLogger(__name__)


# -- steps (module-level so they pickle by reference) ----------------------------------------

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


def match_test_sets(record: dict, index, progress_dir: str | None = None) -> dict:
    """``record``, or its ``duplicate`` row when it matches a test set image (the closest one)."""
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


def _kind(row) -> str:
    """What a pipeline element is: a source item, or a row's ``_t`` (record, rejected, duplicate, shard)."""
    return row["_t"] if isinstance(row, dict) else "item"


def _is(row, kind: str) -> bool:
    return _kind(row) == kind


def _count(name: str):
    def fn(row):
        from apache_beam.metrics import Metrics

        suffix = row.get("reason") or row.get("cause") or ""
        Metrics.counter(NAMESPACE, f"{name}.{suffix}" if suffix else name).inc()
        return row

    return fn


def _row_bytes(packed: str) -> int:
    from pipelines.spill import Ref

    return Ref.unpack(packed).blob[2] + shard_writer.ROW_OVERHEAD


def _assign_shard(packed: str, num_shards: int) -> tuple[int, str]:
    from pipelines.spill import Ref

    return shard_writer.shard_of(Ref.unpack(packed).content_hash, num_shards), packed


# -- graph helpers ---------------------------------------------------------------------------

def _split(pcoll, name: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    """``pcoll`` split by kind, one ``Filter`` each: the same on every runner, unlike tagged outputs."""
    import apache_beam as beam

    return {kind: pcoll | f"{name}{kind.capitalize()}" >> beam.Filter(_is, kind) for kind in kinds}


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


# -- stages ----------------------------------------------------------------------------------

def _read(p, plan: list[str], cfg: PrepareConfig, progress_dir: str | None) -> tuple[Any, dict]:
    """(the inputs count row, the items and the rejected rows) of the plan's chunk files."""
    import apache_beam as beam

    max_bytes = int(cfg.max_file_mb * 1e6)
    # As bytes: an output folder's name need not be UTF-8, which Beam's str coder requires.
    chunks = [path.encode("utf-8", "surrogateescape") for path in plan]
    units = p | "Plan" >> beam.Create(chunks) | "Units" >> beam.FlatMap(staging.read_plan_chunk)
    read = units | "Read" >> beam.FlatMap(_read_unit, max_bytes, progress_dir, cfg.roots())
    return _count_row((read,), "Inputs", "inputs"), _split(read, "Read", ("item", "rejected"))


def _decode(items, cfg: PrepareConfig, opts: ProcessOptions, progress_dir: str | None) -> dict:
    """Items -> records and rejected rows (decode, validate, hash, resize, encode)."""
    import apache_beam as beam

    if cfg.isolate_decoder:
        # A crash of a native decoder kills the process, so no except clause sees it: Beam's
        # subprocess dead letter does. Tagged outputs again, so config refuses this on Dask.
        isolated = items | "Process" >> beam.Map(_process, opts, progress_dir).with_exception_handling(
            use_subprocess=True
        )
        crashed = isolated["bad"] | "ItemCrashed" >> beam.Map(_item_crashed, progress_dir)
        processed = (isolated["good"], crashed) | "AllProcessed" >> beam.Flatten()
    else:
        processed = items | "Process" >> beam.Map(_process, opts, progress_dir)
    return _split(processed, "Processed", ("record", "rejected"))


def _match(p, records, index, progress_dir: str | None) -> tuple[Any, list]:
    """(records that match no test set, [their duplicate rows]); records unchanged without an index."""
    import apache_beam as beam
    from apache_beam.pvalue import AsSingleton

    if index is None:
        return records, []
    index_side = AsSingleton(p | "TestSetIndex" >> beam.Create([index]))
    matched = records | "MatchTestSets" >> beam.Map(match_test_sets, index_side, progress_dir)
    kinds = _split(matched, "Matched", ("record", "duplicate"))
    return kinds["record"], [kinds["duplicate"]]


def _labels(p, records, label_map: Mapping[str, int] | None):
    """A one-element PCollection: the given label map, else ids for every label name in sorted order
    (:func:`pipelines.labels.default_label_map`: integers by value)."""
    import apache_beam as beam

    if label_map is not None:
        return p | "GivenLabels" >> beam.Create([dict(label_map)])
    # Names from every record that reaches the shards, dropped corpus duplicates included:
    # the label map must exist before the shard writers run.
    return (
        records
        | "LabelNames" >> beam.FlatMap(lambda r: r["labels"])
        | "DistinctLabels" >> beam.Distinct()
        | "SortLabels" >> beam.combiners.ToList()
        | "LabelIds" >> beam.Map(default_label_map)
    )


def _shard(records, labels, cfg: PrepareConfig, out_url: str, staging_url: str,
           progress_dir: str | None) -> tuple[Any, dict]:
    """(the count row of records entering the shuffle, the shard entries and corpus duplicate rows)."""
    import apache_beam as beam
    from apache_beam.pvalue import AsSingleton

    from pipelines.spill import SpillRecords

    refs = records | "SpillRecords" >> beam.ParDo(SpillRecords(staging_url))
    # Counted again where the records enter the shuffle, so that a mismatch in the
    # accounting says on which side of it items went missing.
    to_shards = _count_row((refs,), "Records", "records")
    num_shards = (
        refs
        | "RowBytes" >> beam.Map(_row_bytes)
        | "TotalBytes" >> beam.CombineGlobally(sum)
        | "NumShards" >> beam.Map(shard_writer.num_shards, cfg.shard_mb * 1e6)
    )
    written = (
        refs
        | "AssignShard" >> beam.Map(_assign_shard, AsSingleton(num_shards))
        | "GroupShard" >> beam.GroupByKey()
        | "WriteShard" >> beam.FlatMap(shard_writer.write_shard, out_url, staging_url, AsSingleton(labels),
                                       progress_dir)
    )
    return to_shards, _split(written, "Written", ("shard", "duplicate"))


def build_pipeline(p, plan: list[str], cfg: PrepareConfig, label_map: Mapping[str, int] | None,
                   index, out_url: str, staging_url: str, progress_dir: str | None = None) -> None:
    """Add the ingest to pipeline ``p``; all small outputs go as JSON lines under ``staging_url``.

    ``plan`` holds the paths of the unit chunks :func:`pipelines.staging.write_plan` wrote.
    Workers add their counts to ``progress_dir`` as they go (:mod:`pipelines.worker_counts`).
    """
    import apache_beam as beam

    inputs, read = _read(p, plan, cfg, progress_dir)
    processed = _decode(read["item"], cfg, ProcessOptions.from_config(cfg, label_map), progress_dir)
    records, test_dups = _match(p, processed["record"], index, progress_dir)
    labels = _labels(p, records, label_map)
    to_shards, written = _shard(records, labels, cfg, out_url, staging_url, progress_dir)

    rejected = ((read["rejected"], processed["rejected"]) | "AllRejected" >> beam.Flatten()
                | "CountRejected" >> beam.Map(_count("rejected")))
    dups = (tuple(test_dups) + (written["duplicate"],) | "AllDuplicates" >> beam.Flatten()
            | "CountDuplicates" >> beam.Map(_count("duplicates")))
    label_row = labels | "LabelsRow" >> beam.Map(lambda m: {"_t": "label_map", "map": m})
    # Last, and fed by every step: Beam's DaskRunner computes only the last step's graph.
    (
        (inputs, rejected, dups, written["shard"], label_row, to_shards)
        | "AllOutputs" >> beam.Flatten()
        | "CollectOutputs" >> beam.combiners.ToList()
        | "WriteOutputs" >> beam.Map(staging.write_outputs, f"{staging_url}/{staging.OUTPUTS}")
    )
