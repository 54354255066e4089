"""Enumerate the items of a corpus from any fsspec URL, with or without Beam.

A source is in one of the formats in :data:`READERS`, one module each; when none is named, the
first whose ``detect`` accepts the source reads it, in this order:

* a **shard set** (:mod:`~pipelines.sources.shard_set`): a folder with ``manifest.json``;
* **WebDataset shards** (:mod:`~pipelines.sources.webdataset`): a tar, or a folder of tars, whose
  members pair an image with sidecars by key; also any brace pattern or ``::`` list of archives;
* **Hugging Face Parquet** (:mod:`~pipelines.sources.hf_parquet`): files, or a folder of them,
  whose rows hold the images (a ``datasets`` ``Image`` column);
* an **image folder tree** (:mod:`~pipelines.sources.folder`), tar archives in it included;
* ImageNet-1k's **train archive**, a tar of per-class tars (:mod:`~pipelines.sources.imagenet`);
* a **tar archive** (:mod:`~pipelines.sources.tar`);
* a **manifest** (:mod:`~pipelines.sources.manifest`): CSV, JSONL or Parquet rows naming files;
* any other file is one **image file** (:mod:`~pipelines.sources.files`).

Each :class:`SourceItem` has the item's ``uri`` (a URL fsspec can open; tar members are
``tar://member::archive-url``), its label names and its bytes, read lazily by
:meth:`SourceItem.read`. File, folder and member names that are not valid UTF-8 are read under
their real names but recorded in their :func:`~pipelines.schema.text_uri` form, in the uri and
in the labels alike. Reading failures are not exceptions of the enumeration: they surface as
:class:`~pipelines.decode.BadImage` from ``read()`` so that one bad file never stops a walk over
a million.

The work is split into :class:`Unit` s (a chunk of files, one archive, one shard), each expanded
by the reader its ``kind`` names, so the Beam pipeline can read units in parallel;
:func:`iter_items` simply expands them in order. A new format is a module with a ``READER``,
added to :data:`READERS`.
"""
from __future__ import annotations

from typing import Iterator

from common.fs import url_to_fs
from pipelines.schema import text_uri
from pipelines.sources import files, folder, hf_parquet, imagenet, manifest, shard_set, tar, webdataset
from pipelines.sources.base import (
    DEFAULT_MAX_BYTES,
    FILES_PER_UNIT,
    PlanOptions,
    Reader,
    SourceError,
    SourceItem,
    Unit,
)

#: Every format by name, in the order they are tried on a source whose format is not named.
READERS: dict[str, Reader] = {r.name: r for r in (
    shard_set.READER,
    webdataset.READER,
    hf_parquet.READER,
    folder.READER, imagenet.READER, tar.READER, manifest.READER, files.READER,
)}

__all__ = ["DEFAULT_MAX_BYTES", "FILES_PER_UNIT", "READERS", "PlanOptions", "Reader", "SourceError", "SourceItem",
           "Unit", "detect_format", "expand", "iter_items", "known_items", "plan"]


def _reader(name: str) -> Reader:
    try:
        return READERS[name.replace("-", "_")]
    except KeyError:
        raise SourceError(f"format {name!r} is not known; use one of {', '.join(READERS)}") from None


def _located(source: str) -> list[tuple[str, object, str]]:
    """(url, fs, path) of each file ``source`` names: itself, or the shards of a brace pattern or ``::`` list."""
    urls = webdataset.shard_urls(source)
    if urls is None or "::" not in source:  # a literal path wins over a brace pattern
        fs, path = url_to_fs(source)
        path = path.rstrip("/") or "/"
        if fs.exists(path):
            return [(source, fs, path)]
    if urls is None:
        raise SourceError(f"{source}: input not found; pass an existing folder, archive, manifest or shard set")
    out = []
    for url in urls:
        fs, path = url_to_fs(url)
        if not fs.exists(path):
            raise SourceError(f"{url}: input not found (named by {source}); check the pattern's range")
        out.append((url, fs, path))
    return out


def detect_format(source: str) -> str:
    """The name of the reader that reads ``source`` when no format is named: the first that detects it."""
    _, fs, path = _located(source)[0]
    return next(r.name for r in READERS.values() if r.detect(fs, path))


def plan(source: str, *, files_per_unit: int = FILES_PER_UNIT, fmt: str | None = None,
         options: PlanOptions | None = None) -> list[Unit]:
    """Split ``source`` into units, read as format ``fmt`` (by default, the first that detects it).

    Raises :class:`SourceError` if it does not exist or is unreadable.
    """
    located = _located(source)
    reader = _reader(fmt if fmt is not None else detect_format(source))
    options = options or PlanOptions()
    return [unit for url, fs, path in located for unit in reader.plan(url, fs, path, files_per_unit, options)]


def expand(unit: Unit, *, max_bytes: int | None = None,
           allowed_roots: tuple[str, ...] | None = None) -> Iterator[SourceItem]:
    """The items of one unit. Items of ``files`` units read lazily; archive members are read as the archive streams.

    A file or member of more than ``max_bytes`` bytes becomes an item with the error
    ``too_large`` instead of being read whole (``None``: no limit). With ``allowed_roots``
    (normalised by :func:`common.fs.normalize_root`), a file or archive whose real path lies
    under none of them becomes an ``outside_allowed_roots`` item and is not opened.
    """
    if unit.error is not None:
        yield SourceItem(text_uri(unit.uris[0]), error=unit.error)
        return
    reader = READERS.get(unit.kind)
    if reader is None or reader.expand is None:
        raise ValueError(f"unknown unit kind {unit.kind!r}")
    yield from reader.expand(unit, max_bytes, allowed_roots)


def known_items(unit: Unit) -> int | None:
    """How many items ``unit`` holds, when planning already listed them (files, manifest rows); else None."""
    return 1 if unit.error is not None else READERS[unit.kind].known_items(unit)


def iter_items(source: str, *, max_bytes: int | None = DEFAULT_MAX_BYTES,
               allowed_roots: tuple[str, ...] | None = None) -> Iterator[SourceItem]:
    """Every item of ``source`` in a deterministic order (see the module docstring for source kinds).

    Items come with their bytes loaded (``item.data``); an item that could not be
    read has ``data=None`` and ``error=(reason, detail)``, and ``item.read()``
    raises the matching :class:`~pipelines.decode.BadImage`. A file above ``max_bytes``
    is not read past it (``too_large``), and ``allowed_roots`` hold, as in the ingest.
    """
    for unit in plan(source):
        for item in expand(unit, max_bytes=max_bytes, allowed_roots=allowed_roots):
            yield item.materialize()
