"""Enumerate the items of a corpus from any fsspec URL, with or without Beam.

A *source* is one of:

* an **image folder tree**: every file under the root is an item and its class
  is the name of the first-level sub-folder (``train/n01440764/x.JPEG`` ->
  ``n01440764``, the ImageNet layout; files directly under the root have no
  label). Hidden files and folders (``.DS_Store``, ``._x.jpg``) are skipped.
  Any other file is an item, so a stray ``README.txt`` is quarantined as
  ``not_an_image`` rather than silently ignored.
* **tar archives** (``.tar``, ``.tar.gz``, ``.tgz``, ``.tar.bz2``, ``.tar.xz``), given
  directly or found in a folder tree. A member's class is the name of the
  folder it sits in inside the archive, else the archive's folder-tree class,
  else the archive's stem: ImageNet-21k ships one ``n01440764.tar`` per class.
* a **manifest** (``.csv``, ``.jsonl``/``.ndjson``, ``.parquet``) with a ``uri``
  column and a ``label`` (one) or ``labels`` (several: a list, a JSON list
  string, or names joined by ``|``) column, JFT-style. Relative uris are
  resolved against the manifest's folder.
* an existing **shard set** (a folder with ``manifest.json``), to re-shard or
  re-size it; ``removed.jsonl`` is honoured.

Each :class:`SourceItem` has the item's ``uri`` (a URL fsspec can open; tar
members are ``tar://member::archive-url``), its label names and its bytes,
read lazily by :meth:`SourceItem.read`. File, folder and member names that are
not valid UTF-8 are read under their real names but recorded in their
:func:`~pipelines.schema.text_uri` form, in the uri and in the labels alike.
Reading failures are not exceptions of the enumeration: they surface as
:class:`~pipelines.decode.BadImage` from ``read()`` so that one bad file never
stops a walk over a million.

The work is split into :class:`Unit` s (a chunk of files, one archive, one
shard) so the Beam pipeline can read units in parallel; :func:`iter_items`
simply expands them in order.
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import io
import json
import os
import posixpath
import stat
import tarfile
from typing import Callable, Iterator

import fsspec
import pyarrow.parquet as pq
from PIL import Image

from common.config import InputError
from common.fs import irregular_file, irregular_reason, is_local, local_target, url_to_fs, within_roots
from pipelines.decode import DEFAULT_MAX_FILE_MB, BadImage
from pipelines.schema import MANIFEST, ShardSet, ShardSetError, make_key, text_uri

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
MANIFEST_SUFFIXES = (".csv", ".jsonl", ".ndjson", ".parquet")
FILES_PER_UNIT = 16
DEFAULT_MAX_BYTES = int(DEFAULT_MAX_FILE_MB * 1e6)


class SourceError(InputError):
    """A source that cannot be enumerated at all (missing path, unreadable manifest)."""


@dataclasses.dataclass(frozen=True)
class SourceItem:
    """One input item. ``read()`` returns its bytes or raises ``BadImage``."""

    uri: str
    labels: tuple[str, ...] = ()
    data: bytes | None = None
    reader: Callable[[], bytes] | None = dataclasses.field(default=None, compare=False, repr=False)
    error: tuple[str, str] | None = None  # (reason, detail) when the item could not be read

    @property
    def key(self) -> str:
        """The shard ``key`` this item gets (:func:`pipelines.schema.make_key` of its uri)."""
        return make_key(self.uri)

    def read(self) -> bytes:
        if self.error is not None:
            raise BadImage(*self.error)
        if self.data is not None:
            return self.data
        if self.reader is None:
            raise BadImage("unreadable", f"{self.uri}: item has neither bytes nor a reader")
        return self.reader()

    def materialize(self) -> "SourceItem":
        """The same item with its bytes (or its read error) loaded, and no reader: picklable."""
        if self.reader is None:
            return self
        try:
            return dataclasses.replace(self, data=self.reader(), reader=None)
        except BadImage as exc:
            return dataclasses.replace(self, reader=None, error=(exc.reason, exc.detail))


@dataclasses.dataclass(frozen=True)
class Unit:
    """A picklable piece of a source that one worker expands into items."""

    kind: str  # "files", "tar", "shard" or "error"
    uris: tuple[str, ...]
    labels: tuple[tuple[str, ...], ...] = ()  # per uri for "files"; (default,) for "tar"
    index: int = 0  # shard index for "shard"
    error: tuple[str, str] | None = None


def _has_suffix(path: str, suffixes: tuple[str, ...]) -> bool:
    return path.lower().endswith(suffixes)


def _is_hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def _too_large_detail(uri: str, size: int | None, max_bytes: int) -> str:
    """The ``too_large`` detail: the size when known, else that the file passed the limit."""
    what = f"{size / 1e6:.1f} MB" if size is not None else f"more than {max_bytes / 1e6:g} MB"
    return text_uri(f"{uri}: {what}, above max_file_mb={max_bytes / 1e6:g}; not read further")


def _refuse_irregular(url: str) -> None:
    why = irregular_file(url)
    if why:
        raise BadImage("not_a_regular_file", text_uri(f"{url}: {why}; only regular files are read"))


def _open_local(url: str, path: str, max_bytes: int | None):
    """``path`` opened for reading without blocking on a FIFO, and refused unless it is a regular file.

    The ``stat`` before the open (:func:`_refuse_irregular`) keeps devices closed; this
    ``fstat`` of what was actually opened closes the gap of a file swapped in between, and
    gives the size, so a file above ``max_bytes`` is refused without reading any of it.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        why = irregular_reason(st)
        if why:
            raise BadImage("not_a_regular_file", text_uri(f"{url}: {why}; only regular files are read"))
        if max_bytes is not None and stat.S_ISREG(st.st_mode) and st.st_size > max_bytes:
            raise BadImage("too_large", _too_large_detail(url, st.st_size, max_bytes))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _refuse_outside(url: str, allowed_roots: tuple[str, ...] | None) -> None:
    if allowed_roots is not None and not within_roots(url, allowed_roots):
        raise BadImage("outside_allowed_roots", text_uri(
            f"{url}: not under --allowed-roots ({', '.join(allowed_roots)}); not read"))


def _read_url(url: str, max_bytes: int | None = None, allowed_roots: tuple[str, ...] | None = None) -> bytes:
    try:
        _refuse_outside(url, allowed_roots)
        _refuse_irregular(url)
        local = local_target(url) if "::" not in url else None
        if local is not None and allowed_roots is not None:
            local = os.path.realpath(local)  # the path that was checked, not a symlink that may change
        with (_open_local(url, local, max_bytes) if local is not None else fsspec.open(url, "rb")) as f:
            limit = max_bytes
            if local is not None and limit is not None:
                # A buffer of the file's own size, not of the limit: memory follows the file.
                limit = min(limit, os.fstat(f.fileno()).st_size)
            # Reads one byte past the limit instead of asking the size: one request less on object stores.
            data = f.read() if limit is None else f.read(limit + 1)
    except BadImage:
        raise
    except FileNotFoundError:
        raise BadImage("unreadable", f"{text_uri(url)}: file not found") from None
    except IsADirectoryError:
        raise BadImage("unreadable", f"{text_uri(url)}: is a directory, not a file") from None
    except Exception as exc:
        raise BadImage("unreadable", text_uri(f"{url}: cannot be read ({type(exc).__name__}: {exc})")) from None
    if max_bytes is not None and len(data) > max_bytes:
        raise BadImage("too_large", _too_large_detail(url, None, max_bytes))
    return data


class _HandOver:
    """A reader of bytes already read (an archive member's) that lets go of them when they are read."""

    def __init__(self, data: bytes, uri: str):
        self.data, self.uri = data, uri

    def __call__(self) -> bytes:
        data, self.data = self.data, None
        if data is None:
            raise BadImage("unreadable", text_uri(f"{self.uri}: read a second time; its bytes were handed over"))
        return data


def _text_labels(labels: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(text_uri(name) for name in labels)


def _tar_stem(path: str) -> str:
    name = posixpath.basename(path)
    for suffix in TAR_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def plan(source: str, *, files_per_unit: int = FILES_PER_UNIT) -> list[Unit]:
    """Split ``source`` into units; raises :class:`SourceError` if it does not exist or is unreadable."""
    fs, path = url_to_fs(source)
    path = path.rstrip("/") or "/"
    if not fs.exists(path):
        raise SourceError(f"{source}: input not found; pass an existing folder, archive, manifest or shard set")
    if fs.isdir(path):
        if fs.exists(f"{path}/{MANIFEST}"):
            return _plan_shard_set(source, fs, path)
        return _plan_tree(fs, path, files_per_unit)
    url = fs.unstrip_protocol(path)
    why = irregular_file(url)
    if why and _has_suffix(path, MANIFEST_SUFFIXES):
        raise SourceError(f"{source}: {why}, not a manifest file; pass a regular file")
    if _has_suffix(path, TAR_SUFFIXES):
        return [Unit("tar", (url,), ((_tar_stem(path),),))]
    if _has_suffix(path, MANIFEST_SUFFIXES):
        return _plan_manifest(fs, path, files_per_unit)
    return [Unit("files", (url,), ((),))]


class _FileBatcher:
    """Groups (uri, labels) pairs, in order, into "files" units of at most ``size`` items."""

    def __init__(self, units: list[Unit], size: int):
        self.units, self.size, self.batch = units, size, []

    def add(self, uri: str, labels: tuple[str, ...]) -> None:
        self.batch.append((uri, labels))
        if len(self.batch) == self.size:
            self.flush()

    def flush(self) -> None:
        if self.batch:
            self.units.append(Unit("files", tuple(u for u, _ in self.batch), tuple(l for _, l in self.batch)))
            self.batch = []


def _local_tree_files(root: str) -> list[str]:
    """Every file under a local ``root``, through symlinked folders, each folder walked once.

    fsspec's ``find`` lists a symlinked class folder as one file, which then fails to read.
    A link back to a folder already walked (a loop) is skipped.
    """
    seen: set[tuple[int, int]] = set()
    files = []
    for top, dirs, names in os.walk(root, followlinks=True):
        st = os.stat(top)
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        files.extend(f"{top}/{name}" for name in names)
    return files


def _plan_tree(fs, root: str, files_per_unit: int) -> list[Unit]:
    units: list[Unit] = []
    files = _FileBatcher(units, files_per_unit)
    for path in sorted(_local_tree_files(root) if is_local(fs) else fs.find(root, withdirs=False)):
        rel = path[len(root):].lstrip("/")
        if not rel or _is_hidden(rel):
            continue
        parts = rel.split("/")
        labels = (parts[0],) if len(parts) > 1 else ()
        url = fs.unstrip_protocol(path)
        if _has_suffix(path, TAR_SUFFIXES):
            units.append(Unit("tar", (url,), (labels or (_tar_stem(path),),)))
            continue
        files.add(url, labels)
    files.flush()
    return units


def _plan_shard_set(source: str, fs, root: str) -> list[Unit]:
    url = fs.unstrip_protocol(root)
    try:
        shard_set = ShardSet(url)
    except ShardSetError as exc:
        raise SourceError(f"{source}: a shard set that cannot be read: {exc}") from None
    return [Unit("shard", (url,), index=i) for i in range(len(shard_set.shards))]


def _parse_labels(value, *, multi: bool) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, float) and value != value:  # NaN from pandas-written files
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(str(v) for v in value if v is not None and str(v) != "")
    if hasattr(value, "tolist"):
        return _parse_labels(value.tolist(), multi=multi)
    text = str(value).strip()
    if not text:
        return ()
    if multi:
        if text.startswith("["):
            try:
                return _parse_labels(json.loads(text), multi=True)
            except json.JSONDecodeError:
                pass
        return tuple(part.strip() for part in text.split("|") if part.strip())
    return (text,)


def _manifest_rows(fs, path: str) -> Iterator[dict]:
    lower = path.lower()
    try:
        if lower.endswith(".parquet"):
            with fs.open(path, "rb") as f:
                yield from pq.read_table(f).to_pylist()
        elif lower.endswith(".csv"):
            # surrogateescape: a row naming a file by its Latin-1 bytes still opens that file
            # (and is recorded in text_uri form) instead of failing the whole manifest.
            with fs.open(path, "rt", newline="", encoding="utf-8", errors="surrogateescape") as f:
                yield from csv.DictReader(f)
        else:
            with fs.open(path, "rt", encoding="utf-8", errors="surrogateescape") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        row = {"__error__": f"line {lineno} is not valid JSON"}
                    yield row if isinstance(row, dict) else {"__error__": f"line {lineno} is not a JSON object"}
    except Exception as exc:
        raise SourceError(f"{fs.unstrip_protocol(path)}: cannot read manifest ({type(exc).__name__}: {exc})") from None


def _plan_manifest(fs, path: str, files_per_unit: int) -> list[Unit]:
    base = posixpath.dirname(path)
    manifest_url = fs.unstrip_protocol(path)
    units: list[Unit] = []
    files = _FileBatcher(units, files_per_unit)
    columns_checked = False
    for n, row in enumerate(_manifest_rows(fs, path)):
        if not columns_checked and "__error__" not in row:
            if "uri" not in row:
                raise SourceError(
                    f"{manifest_url}: manifest has no 'uri' column (columns: {', '.join(map(str, row))}); "
                    "name the image column 'uri' and the label column 'label' or 'labels'"
                )
            columns_checked = True
        uri = row.get("uri")
        if "__error__" in row or not isinstance(uri, str) or not uri.strip():
            why = row.get("__error__") or f"row {n} has no uri"
            files.flush()  # keep manifest order
            units.append(Unit("error", (f"{manifest_url}#row={n}",), error=("bad_manifest_row", f"{manifest_url}: {why}")))
            continue
        uri = uri.strip()
        if "://" not in uri and "::" not in uri:
            uri = fs.unstrip_protocol(uri if uri.startswith("/") else posixpath.normpath(posixpath.join(base, uri)))
        if "labels" in row:
            labels = _parse_labels(row["labels"], multi=True)
        else:
            labels = _parse_labels(row.get("label"), multi=False)
        files.add(uri, labels)
    files.flush()
    return units


def expand(unit: Unit, *, max_bytes: int | None = None,
           allowed_roots: tuple[str, ...] | None = None) -> Iterator[SourceItem]:
    """The items of one unit. Items of ``files`` units read lazily; archive members are read as the archive streams.

    A file or member of more than ``max_bytes`` bytes becomes an item with the error
    ``too_large`` instead of being read whole (``None``: no limit). With ``allowed_roots``
    (normalised by :func:`common.fs.normalize_root`), a file or archive whose real path lies
    under none of them becomes an ``outside_allowed_roots`` item and is not opened.
    """
    if unit.kind == "error":
        yield SourceItem(text_uri(unit.uris[0]), error=unit.error)
    elif unit.kind == "files":
        for uri, labels in zip(unit.uris, unit.labels):
            # A picklable reader: the bytes are read where the item is processed, one file at a time.
            yield SourceItem(text_uri(uri), _text_labels(labels),
                             reader=functools.partial(_read_url, uri, max_bytes, allowed_roots))
    elif unit.kind == "tar":
        yield from _expand_tar(unit.uris[0], unit.labels[0], max_bytes, allowed_roots)
    elif unit.kind == "shard":
        yield from _expand_shard(unit.uris[0], unit.index)
    else:
        raise ValueError(f"unknown unit kind {unit.kind!r}")


def _expand_tar(url: str, default_labels: tuple[str, ...], max_bytes: int | None = None,
                allowed_roots: tuple[str, ...] | None = None) -> Iterator[SourceItem]:
    members = 0
    try:
        if allowed_roots is not None and not within_roots(url, allowed_roots):
            yield SourceItem(text_uri(url), _text_labels(default_labels), error=("outside_allowed_roots", text_uri(
                f"{url}: not under --allowed-roots ({', '.join(allowed_roots)}); not read")))
            return
        why = irregular_file(url)
        if why:
            yield SourceItem(text_uri(url), _text_labels(default_labels), error=(
                "not_a_regular_file", text_uri(f"{url}: {why}; only regular files are read")))
            return
        with fsspec.open(url, "rb") as raw, tarfile.open(fileobj=raw, mode="r|*") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                name = member.name[2:] if member.name.startswith("./") else member.name
                if _is_hidden(name):
                    continue
                folder = posixpath.dirname(name)
                labels = (posixpath.basename(folder),) if folder else default_labels
                uri = f"tar://{name}::{url}"
                members += 1
                if max_bytes is not None and member.size > max_bytes:
                    # The stream skips the member's data when it moves on; nothing is read.
                    error = ("too_large", _too_large_detail(uri, member.size, max_bytes))
                    yield SourceItem(text_uri(uri), _text_labels(labels), error=error)
                    continue
                f = archive.extractfile(member)
                # Handed over once: whoever decodes the member holds its bytes, and nothing of the
                # stream or the runner keeps them while the next member is read.
                yield SourceItem(text_uri(uri), _text_labels(labels),
                                 reader=_HandOver(f.read() if f is not None else b"", uri))
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        where = f"after {members} member(s)" if members else "before the first member"
        yield SourceItem(text_uri(url), _text_labels(default_labels), error=("corrupt_archive", text_uri(
            f"{url}: archive unreadable {where} ({type(exc).__name__}: {exc}); the rest of it is skipped"
        )))


def _expand_shard(url: str, index: int) -> Iterator[SourceItem]:
    shard_set = ShardSet(url)
    names = shard_set.label_names
    for batch in shard_set.iter_batches([index]):
        for row in batch.to_pylist():
            data = row["image"]
            if row["format"] == "raw":
                buf = io.BytesIO()
                # BMP: lossless and nearly free to encode, so raw rows round-trip exactly.
                Image.frombytes("RGB", (row["width"], row["height"]), data).save(buf, "BMP")
                data = buf.getvalue()
            yield SourceItem(row["source"], tuple(names[i] for i in row["labels"]), data=data)


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
