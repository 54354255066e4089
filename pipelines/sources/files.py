"""Image files named one by one: a single file given as a source, and the ``files`` units that
folders and manifests plan. Each file is read where its item is processed, one at a time."""
from __future__ import annotations

import functools
from typing import Iterator

from pipelines.schema import text_uri
from pipelines.sources.base import Reader, SourceItem, Unit, read_url, text_labels


def _plan(source: str, fs, path: str, files_per_unit: int, options=None) -> list[Unit]:
    return [Unit("files", (fs.unstrip_protocol(path),), ((),))]


def _expand(unit: Unit, max_bytes: int | None, allowed_roots: tuple[str, ...] | None) -> Iterator[SourceItem]:
    for uri, labels in zip(unit.uris, unit.labels):
        # A picklable reader: the bytes are read where the item is processed, one file at a time.
        yield SourceItem(text_uri(uri), text_labels(labels),
                         reader=functools.partial(read_url, uri, max_bytes, allowed_roots))


READER = Reader("files", detect=lambda fs, path: True, plan=_plan, expand=_expand,
                known_items=lambda unit: len(unit.uris))
