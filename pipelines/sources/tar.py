"""Tar archives (``.tar``, ``.tar.gz``, ``.tgz``, ``.tar.bz2``, ``.tar.xz``), streamed member by member.

A member's class follows the folder reader's rule (:mod:`pipelines.sources.folder`), the archive
read as the folder that was tarred: an archive inside a class folder gives its members that class;
otherwise a member's class is its first folder level inside the archive, below a top folder named
as the archive (``tar czf train.tar.gz train/`` holds ``train/cat/1.jpg``: class ``cat``). A member
in no class folder takes its label from ``--labels`` when given (ImageNet's validation tar, a flat
tar of JPEGs), else the archive's stem, as ImageNet-21k's one ``n01440764.tar`` per class needs;
the Beam counter ``labels_from_archive_name`` counts those and each worker says so once.
"""
from __future__ import annotations

import dataclasses
import logging
import posixpath
import tarfile
from typing import Iterator

import fsspec

from common.fs import irregular_file, within_roots
from pipelines.decode import BadImage
from pipelines.schema import text_uri
from pipelines.sources.base import (
    Reader,
    SourceItem,
    Unit,
    has_suffix,
    is_hidden,
    outside_detail,
    text_labels,
    too_large_detail,
)

log = logging.getLogger(__name__)
_said_fallback = False

SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")


def is_tar(path: str) -> bool:
    return has_suffix(path, SUFFIXES)


def _stem(path: str) -> str:
    name = posixpath.basename(path)
    for suffix in SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def unit(url: str, path: str, labels: tuple[str, ...] = ()) -> Unit:
    """The unit of one archive; ``labels``: the class of the folder it sits in, if any."""
    return Unit("tar", (url,), (labels,))


def member_labels(name: str, folder_labels: tuple[str, ...], stem: str) -> tuple[str, ...] | None:
    """A member's class by the folder reader's rule, or None when it sits in no class folder."""
    if folder_labels:
        return folder_labels
    parts = name.split("/")
    if len(parts) > 1 and parts[0] == stem:  # the tarred folder itself: ``tar cf val.tar val/``
        parts = parts[1:]
    return (parts[0],) if len(parts) > 1 else None


def _fell_back(url: str, stem: str, n: int) -> None:
    """Counts the members labelled with the archive's name, and says so once per process."""
    global _said_fallback
    from apache_beam.metrics import Metrics

    Metrics.counter("prepare", "labels_from_archive_name").inc(n)
    if not _said_fallback:
        _said_fallback = True
        log.warning("%s: %d member(s) sit in no class folder and take the archive's name %r as their class "
                    "(one archive per class, as ImageNet-21k); put them in class folders if that is wrong",
                    text_uri(url), n, stem)


def _plan(source: str, fs, path: str, files_per_unit: int, options=None) -> list[Unit]:
    return [unit(fs.unstrip_protocol(path), path)]


class _HandOver:
    """A reader of bytes already read (an archive member's) that lets go of them when they are read."""

    def __init__(self, data: bytes, uri: str):
        self.data, self.uri = data, uri

    def __call__(self) -> bytes:
        data, self.data = self.data, None
        if data is None:
            raise BadImage("unreadable", text_uri(f"{self.uri}: read a second time; its bytes were handed over"))
        return data


def _refused(url: str, default_labels: tuple[str, ...], allowed_roots: tuple[str, ...] | None) -> SourceItem | None:
    """The one item of an archive that is not opened: outside the allowed roots, or not a regular file."""
    if allowed_roots is not None and not within_roots(url, allowed_roots):
        return SourceItem(text_uri(url), text_labels(default_labels),
                          error=("outside_allowed_roots", outside_detail(url, allowed_roots)))
    why = irregular_file(url)
    if why:
        return SourceItem(text_uri(url), text_labels(default_labels), error=(
            "not_a_regular_file", text_uri(f"{url}: {why}; only regular files are read")))
    return None


def file_members(archive) -> Iterator[tuple[tarfile.TarInfo, str]]:
    """(member, name without a leading ``./``) of each regular, not hidden, file as the archive streams."""
    for member in archive:
        if not member.isfile():
            continue
        name = member.name[2:] if member.name.startswith("./") else member.name
        if not is_hidden(name):
            yield member, name


def file_stem(name: str) -> str:
    """A file's name without its folder and extension: how a label file (``--labels``) names it."""
    return posixpath.splitext(posixpath.basename(name))[0]


def unlabelled_members(url: str) -> list[str]:
    """The names of the archive's members that sit in no class folder, from its headers (an
    uncompressed archive is seeked through, not read); as far as it can be read."""
    stem, names = _stem(url), []
    if irregular_file(url):  # a FIFO is never opened; reading it quarantines it
        return names
    try:
        with fsspec.open(url, "rb") as raw, tarfile.open(fileobj=raw, mode="r:*") as archive:
            names.extend(name for _, name in file_members(archive) if member_labels(name, (), stem) is None)
    except (tarfile.TarError, EOFError, OSError, ValueError):
        pass  # reading it quarantines it as corrupt_archive, with where it breaks
    return names


def with_file_labels(u: Unit, by_stem: dict[str, str]) -> Unit:
    """Archive unit ``u`` whose members in no class folder take their label from ``by_stem`` (``--labels``)."""
    stems = tuple(sorted(by_stem))
    return dataclasses.replace(u, labels=(u.labels[0], stems, tuple(by_stem[s] for s in stems)))


def _members(archive, url: str, folder_labels: tuple[str, ...], max_bytes: int | None,
             seen: list[int], fallback: list[int], by_stem: dict[str, str] | None = None) -> Iterator[SourceItem]:
    """The archive's items; ``seen[0]`` counts the members reached, a failing one included, and
    ``fallback[0]`` those labelled with the archive's stem. A member in no class folder takes its
    label from ``by_stem`` (a label file's, by file stem) when that names it."""
    stem = _stem(url)
    for member, name in file_members(archive):
        labels = member_labels(name, folder_labels, stem)
        if labels is None and by_stem and file_stem(name) in by_stem:
            labels = (by_stem[file_stem(name)],)
        if labels is None:
            labels, fallback[0] = (stem,), fallback[0] + 1
        uri = f"tar://{name}::{url}"
        seen[0] += 1
        if max_bytes is not None and member.size > max_bytes:
            # The stream skips the member's data when it moves on; nothing is read.
            yield SourceItem(text_uri(uri), text_labels(labels),
                             error=("too_large", too_large_detail(uri, member.size, max_bytes)))
            continue
        f = archive.extractfile(member)
        # Handed over once: whoever decodes the member holds its bytes, and nothing of the
        # stream or the runner keeps them while the next member is read.
        yield SourceItem(text_uri(uri), text_labels(labels), reader=_HandOver(f.read() if f is not None else b"", uri))


def _expand(unit: Unit, max_bytes: int | None = None,
            allowed_roots: tuple[str, ...] | None = None) -> Iterator[SourceItem]:
    url, folder_labels = unit.uris[0], unit.labels[0]
    default_labels = folder_labels or (_stem(url),)
    by_stem = dict(zip(unit.labels[1], unit.labels[2])) if len(unit.labels) == 3 else None
    seen, fallback = [0], [0]
    try:
        refused = _refused(url, default_labels, allowed_roots)
        if refused is not None:
            yield refused
            return
        with fsspec.open(url, "rb") as raw, tarfile.open(fileobj=raw, mode="r|*") as archive:
            yield from _members(archive, url, folder_labels, max_bytes, seen, fallback, by_stem)
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        where = f"after {seen[0]} member(s)" if seen[0] else "before the first member"
        yield SourceItem(text_uri(url), text_labels(default_labels), error=("corrupt_archive", text_uri(
            f"{url}: archive unreadable {where} ({type(exc).__name__}: {exc}); the rest of it is skipped"
        )))
    if fallback[0]:
        _fell_back(url, _stem(url), fallback[0])


READER = Reader("tar", detect=lambda fs, path: is_tar(path), plan=_plan, expand=_expand)
