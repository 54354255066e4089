"""Downstream test sets as the ingest and the dedup job read them: decoded images, then an index.

A test set is ``NAME=SRC`` (``config.parse_test_sets``), where SRC is anything the ingest
accepts, shard sets included. Its images are decoded by ``decode.decode_image``, the corpus's
own path, so a test image and its corpus copy reach the signature as the same pixels.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from PIL import Image

from neardup.index import Quarantined, TestSetIndex
from pipelines.decode import BadImage, decode_image
from pipelines.sources import DEFAULT_MAX_BYTES, SourceError, iter_items, plan


@dataclasses.dataclass
class Item:
    key: str
    uri: str
    image: Image.Image | None
    error: tuple[str, str] | None  # (reason, detail) when the image is quarantined


def check_sources(test_sets: dict[str, str]) -> None:
    """Refuse a test set whose source is missing or unreadable before any work starts (``SourceError``)."""
    for name, source in test_sets.items():
        try:
            plan(source)
        except SourceError as exc:
            raise SourceError(f"test_set {name}: {exc}") from None


def iter_images(source: str, *, max_bytes: int | None = DEFAULT_MAX_BYTES,
                allowed_roots: tuple[str, ...] | None = None) -> Iterator[Item]:
    """Every image of ``source``, decoded to 8-bit RGB as the ingest decodes it, or its rejection reason.

    A file above ``max_bytes`` is not read past it (``too_large``), the corpus's own cap, and
    ``allowed_roots`` (``PrepareConfig.roots()``) hold as for the corpus.
    """
    for raw in iter_items(source, max_bytes=max_bytes, allowed_roots=allowed_roots):
        try:
            img = decode_image(raw.read(), uri=raw.uri)
        except BadImage as exc:
            yield Item(raw.key, raw.uri, None, (exc.reason, exc.detail))
        else:
            yield Item(raw.key, raw.uri, img, None)


def add_source(index: TestSetIndex, test_set: str, source: str, *, max_bytes: int | None = DEFAULT_MAX_BYTES,
               allowed_roots: tuple[str, ...] | None = None) -> dict[str, int]:
    """Index every image of ``source`` not yet indexed under ``test_set``; bad images are quarantined.

    Returns counts ``{"seen", "added", "already_indexed", "quarantined"}``.
    """
    counts = {"seen": 0, "added": 0, "already_indexed": 0, "quarantined": 0}
    known_bad = {(q.test_set, q.key) for q in index.quarantine}
    for item in iter_images(source, max_bytes=max_bytes, allowed_roots=allowed_roots):
        counts["seen"] += 1
        if index.has_key(test_set, item.key):
            counts["already_indexed"] += 1
        elif item.error is not None:
            if (test_set, item.key) not in known_bad:
                index.add_quarantine(Quarantined(test_set, item.key, item.uri, *item.error))
            counts["quarantined"] += 1
        else:
            index.add(test_set, item.key, item.image, source=item.uri)
            counts["added"] += 1
    index.commit()
    return counts


def build_test_set_index(test_sets: dict[str, str], *, threshold: int | None = None,
                         base: TestSetIndex | None = None,
                         max_bytes: int | None = DEFAULT_MAX_BYTES,
                         allowed_roots: tuple[str, ...] | None = None) -> TestSetIndex:
    """Index every image of each test set (name -> source); bad images are quarantined, not fatal.

    ``base`` makes the build incremental: images already in it are skipped and new ones go
    into a new version of their test set.
    """
    index = base if base is not None else TestSetIndex(threshold=threshold)
    for name, source in test_sets.items():
        if not name or "=" in name:
            raise ValueError(f"test set name {name!r}: expected a non-empty name without '=' (name=source)")
        add_source(index, name, source, max_bytes=max_bytes, allowed_roots=allowed_roots)
    return index
