"""The shard writer: one shard group of spilled records in, one Arrow IPC file out, written atomically.

A record's shard is a stable hash of its content hash (:func:`shard_of`), so exact copies of
one image meet in one group, and the writer keeps one of them (the smallest key). Rows are
sorted by key inside a shard, so the same inputs give byte-identical shards without a global
sort. The file's sha256 and size are taken as it streams out (:class:`Digest`), never by
reading it back.
"""
from __future__ import annotations

import hashlib
import math
from typing import Iterable, Iterator, Mapping

import pyarrow as pa
import pyarrow.ipc as ipc

from common.fs import atomic_open, url_to_fs
from pipelines import schema, worker_counts
from pipelines.config import NAMESPACE

#: Per-row bytes beyond the image (key, hashes, labels, offsets) when sizing shards.
ROW_OVERHEAD = 160


class Digest:
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


def num_shards(total_bytes: int, shard_bytes: float) -> int:
    """Shards for ``total_bytes`` of rows at ``shard_bytes`` each (``--shard-mb``); at least one."""
    return max(1, math.ceil(total_bytes / shard_bytes))


def shard_of(content_hash: str, num_shards: int) -> int:
    """The shard of a record: by content, so exact duplicates meet in one shard group."""
    return int(content_hash[:8], 16) % num_shards


def pick_unique(records: Iterable) -> tuple[list, list[tuple]]:
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


def _rows(records: list[tuple[bytes, dict]], label_map: Mapping[str, int]) -> list[dict]:
    return [{
        schema.KEY: r["key"], schema.IMAGE: image, schema.FORMAT: r["format"],
        schema.HEIGHT: r["height"], schema.WIDTH: r["width"],
        schema.LABELS: sorted({label_map[label] for label in r["labels"]}),
        schema.SOURCE: r["uri"], schema.CONTENT_HASH: r["content_hash"], schema.PHASH: r["phash"],
    } for image, r in records]


def _write_file(f, kept: list, blobs, label_map: Mapping[str, int]) -> Digest:
    """``kept`` as one Arrow IPC file into ``f``, one output batch at a time; returns its digest.

    Besides the refs, only one batch of rows is ever held as Arrow arrays, and the file's
    bytes are never held whole.
    """
    sink = Digest(f)
    with ipc.new_file(pa.PythonFile(sink, mode="w"), schema.SCHEMA) as writer:
        for start in range(0, len(kept), schema.BATCH_ROWS):
            rows = _rows(blobs.read_records(kept[start:start + schema.BATCH_ROWS]), label_map)
            writer.write_table(schema.records_to_table(rows))
            # Arrow's allocator (mimalloc) otherwise keeps what each batch freed: a worker
            # held about a shard's size more after writing one, and more again after the next.
            pa.default_memory_pool().release_unused()
    return sink


def write_shard(group, out_url: str, staging_url: str, label_map: Mapping[str, int],
                progress_dir: str | None = None) -> Iterator[dict]:
    """Write one shard atomically, keeping one record per content hash.

    The group holds packed :class:`pipelines.spill.Ref` strings; each record's image and
    fields are read back from the run's spill files. Yields the shard's manifest entry
    (``_t: shard``), then a ``duplicate`` row for each record dropped.
    """
    from apache_beam.metrics import Metrics

    from pipelines.spill import Blobs, Ref  # loads apache_beam

    index, packed = group
    kept, dropped = pick_unique(Ref.unpack(r) for r in packed)
    kept.sort(key=lambda r: r.key)
    name = schema.shard_name(index)
    fs, root = url_to_fs(out_url)
    with atomic_open(f"{root}/{name}", fs) as f, Blobs(staging_url) as blobs:
        sink = _write_file(f, kept, blobs, label_map)
        uris = [r["uri"] for _, r in blobs.read_records([d for d, _ in dropped])]
    Metrics.counter(NAMESPACE, "written").inc(len(kept))
    Metrics.counter(NAMESPACE, "bytes_written").inc(sink.size)
    worker_counts.count(progress_dir, written=len(kept), duplicates=len(dropped))
    yield {"_t": "shard", "path": name, "rows": len(kept), "bytes": sink.size, "sha256": sink.sha256.hexdigest(),
           "received": len(kept) + len(dropped)}
    for (d, keep), uri in zip(dropped, uris):
        yield {"_t": "duplicate", "key": d.key, "uri": uri, "cause": "corpus", "duplicate_of": keep.key}
