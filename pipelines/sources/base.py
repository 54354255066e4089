"""What every reader shares: the item and unit types, the reader record, and reading one file safely."""
from __future__ import annotations

import dataclasses
import os
import stat
from typing import Callable, Iterator

import fsspec

from common.config import InputError
from common.fs import irregular_file, irregular_reason, local_target, within_roots
from pipelines.decode import DEFAULT_MAX_FILE_MB, BadImage
from pipelines.schema import make_key, text_uri

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
    """A picklable piece of a source that one worker expands into items.

    ``kind`` names the reader that expands it (:data:`pipelines.sources.READERS`). A unit with
    an ``error`` is one item that could not be planned (a bad manifest row), whatever its kind.
    """

    kind: str
    uris: tuple[str, ...]
    # per uri for "files"; (default,) for "tar", or (default, stems, labels) with --labels;
    # ((label_key,) or (),) for "webdataset";
    # (class names, (image column,), (label column,)) for "hf_parquet"
    labels: tuple[tuple[str, ...], ...] = ()
    index: int = 0  # shard index for "shard_set", row group for "hf_parquet"
    error: tuple[str, str] | None = None


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """What a user says about a source that its files do not: where its label is, which split to read."""

    label_key: str | None = None  # a WebDataset .json field, a Parquet column; None: the format's own
    split: str | None = None  # a split of a WebDataset _info.json or a Hugging Face Parquet folder


@dataclasses.dataclass(frozen=True)
class Reader:
    """One input format: how a source of it is recognised, split into units and read back.

    Args:
        name: the format's name, and the ``kind`` of the units it expands.
        detect: ``(fs, path) -> bool``: whether a source is of this format when none is named.
        plan: ``(source, fs, path, files_per_unit, options) -> [Unit]``; may plan units of other
            readers (a folder holds files and archives). ``options`` is a :class:`PlanOptions`.
        expand: ``(unit, max_bytes, allowed_roots) -> items``; None for a format whose plan
            only makes other readers' units.
        known_items: ``unit -> int | None``: the unit's items when planning already counted them.
    """

    name: str
    detect: Callable[..., bool]
    plan: Callable[..., list[Unit]]
    expand: Callable[..., Iterator[SourceItem]] | None = None
    known_items: Callable[[Unit], int | None] = lambda unit: None


def has_suffix(path: str, suffixes: tuple[str, ...]) -> bool:
    return path.lower().endswith(suffixes)


def is_hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def text_labels(labels: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(text_uri(name) for name in labels)


def too_large_detail(uri: str, size: int | None, max_bytes: int) -> str:
    """The ``too_large`` detail: the size when known, else that the file passed the limit."""
    what = f"{size / 1e6:.1f} MB" if size is not None else f"more than {max_bytes / 1e6:g} MB"
    return text_uri(f"{uri}: {what}, above max_file_mb={max_bytes / 1e6:g}; not read further")


def outside_detail(url: str, allowed_roots: tuple[str, ...]) -> str:
    return text_uri(f"{url}: not under --allowed-roots ({', '.join(allowed_roots)}); not read")


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
            raise BadImage("too_large", too_large_detail(url, st.st_size, max_bytes))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _refuse_outside(url: str, allowed_roots: tuple[str, ...] | None) -> None:
    if allowed_roots is not None and not within_roots(url, allowed_roots):
        raise BadImage("outside_allowed_roots", outside_detail(url, allowed_roots))


def read_url(url: str, max_bytes: int | None = None, allowed_roots: tuple[str, ...] | None = None) -> bytes:
    """The bytes of one file, or BadImage: outside the allowed roots, not a regular file, too large, unreadable."""
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
        raise BadImage("too_large", too_large_detail(url, None, max_bytes))
    return data


class FileBatcher:
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
