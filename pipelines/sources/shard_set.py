"""An existing shard set (a folder with ``manifest.json``), to re-shard or re-size it; ``removed.jsonl`` is honoured."""
from __future__ import annotations

import io
from typing import Iterator

from PIL import Image

from pipelines.schema import MANIFEST, ShardSet, ShardSetError
from pipelines.sources.base import Reader, SourceError, SourceItem, Unit


def _detect(fs, path: str) -> bool:
    return fs.isdir(path) and fs.exists(f"{path}/{MANIFEST}")


def _plan(source: str, fs, root: str, files_per_unit: int, options=None) -> list[Unit]:
    url = fs.unstrip_protocol(root)
    try:
        shard_set = ShardSet(url)
    except ShardSetError as exc:
        raise SourceError(f"{source}: a shard set that cannot be read: {exc}") from None
    return [Unit("shard_set", (url,), index=i) for i in range(len(shard_set.shards))]


def _expand(unit: Unit, max_bytes: int | None = None,
            allowed_roots: tuple[str, ...] | None = None) -> Iterator[SourceItem]:
    shard_set = ShardSet(unit.uris[0])
    names = shard_set.label_names
    for batch in shard_set.iter_batches([unit.index]):
        for row in batch.to_pylist():
            data = row["image"]
            if row["format"] == "raw":
                buf = io.BytesIO()
                # BMP: lossless and nearly free to encode, so raw rows round-trip exactly.
                Image.frombytes("RGB", (row["width"], row["height"]), data).save(buf, "BMP")
                data = buf.getvalue()
            yield SourceItem(row["source"], tuple(names[i] for i in row["labels"]), data=data)


READER = Reader("shard_set", detect=_detect, plan=_plan, expand=_expand)
