"""ImageNet-1k's train archive: a tar of per-class tars, read member by member with no extraction.

``ILSVRC2012_img_train.tar`` holds ``n01440764.tar`` ... ``n15075141.tar``, each holding that
class's ``n01440764_10026.JPEG`` ... An image's label is its inner tar's WNID. Class ids follow
the label map's default, the sorted WNIDs, which is the order torchvision and timm use, so ids
match published models.

The archive may be the input, or sit in a folder input (:mod:`pipelines.sources.folder` plans
it here). An uncompressed outer archive is planned as one unit per inner tar (its header offset), so the
classes are read in parallel; a compressed one can only be streamed, as one unit.
"""
from __future__ import annotations

import dataclasses
import posixpath
import tarfile
from typing import Iterator

import fsspec

from pipelines.decode import BadImage
from pipelines.schema import text_uri
from pipelines.sources import tar
from pipelines.sources.base import Reader, SourceItem, Unit, is_hidden, text_labels

NAME = "imagenet"
STREAM = -1  # the unit's index when the outer archive is compressed: stream it whole
PROBE_BYTES = 1 << 16


def _inner(member: tarfile.TarInfo) -> bool:
    return member.isfile() and tar.is_tar(member.name) and not is_hidden(member.name)


def _detect(fs, path: str) -> bool:
    """A tar archive whose first member is itself a tar archive."""
    if not tar.is_tar(path) or not fs.isfile(path):
        return False
    try:
        # A small block: a folder of many archives is probed one header each, not megabytes each.
        with fs.open(path, "rb", block_size=PROBE_BYTES) as raw, tarfile.open(fileobj=raw, mode="r|*") as archive:
            first = next(iter(archive), None)
    except (tarfile.TarError, EOFError, OSError, ValueError):
        return False
    return first is not None and _inner(first)


def _wnid(member_name: str) -> str:
    return tar._stem(posixpath.basename(member_name))


def _plan(source: str, fs, path: str, files_per_unit: int, options=None) -> list[Unit]:
    url = fs.unstrip_protocol(path)
    if not path.lower().endswith(".tar"):
        return [Unit(NAME, (url,), ((),), index=STREAM)]
    units = []
    try:
        with fs.open(path, "rb") as raw, tarfile.open(fileobj=raw, mode="r:") as archive:
            for member in archive:  # headers only: the members' data is seeked past
                if member.isfile() and not is_hidden(member.name):
                    units.append(Unit(NAME, (url,), ((_wnid(member.name),) if _inner(member) else (),),
                                      index=member.offset))
    except (tarfile.TarError, EOFError, OSError, ValueError):
        return [Unit(NAME, (url,), ((),), index=STREAM)]  # the stream reports where it breaks
    return units


def _member_items(outer, member: tarfile.TarInfo, url: str, max_bytes: int | None) -> Iterator[SourceItem]:
    """The items of one member of the outer archive: an inner tar's images, labelled by its WNID, or
    the member itself when it is not a tar."""
    name = member.name[2:] if member.name.startswith("./") else member.name
    uri = f"tar://{name}::{url}"
    f = outer.extractfile(member)
    if not _inner(member):
        yield SourceItem(text_uri(uri), reader=tar._HandOver(f.read() if f is not None else b"", uri))
        return
    labels = text_labels((_wnid(name),))
    seen = [0]
    try:
        with tarfile.open(fileobj=f, mode="r|*") as archive:
            for item in tar._members(archive, uri, (_wnid(name),), max_bytes, seen, [0]):
                # The class is the inner tar's, whatever folders its members sit in.
                yield item if item.labels == labels else dataclasses.replace(item, labels=labels)
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        where = f"after {seen[0]} member(s)" if seen[0] else "before the first member"
        yield SourceItem(text_uri(uri), labels, error=("corrupt_archive", text_uri(
            f"{uri}: archive unreadable {where} ({type(exc).__name__}: {exc}); the rest of it is skipped")))


def _members(raw, unit: Unit, max_bytes: int | None) -> Iterator[SourceItem]:
    url = unit.uris[0]
    if unit.index == STREAM:
        with tarfile.open(fileobj=raw, mode="r|*") as outer:
            for member, _ in tar.file_members(outer):
                yield from _member_items(outer, member, url, max_bytes)
        return
    raw.seek(unit.index)
    outer = tarfile.open(fileobj=raw, mode="r:")  # reads from here: the one member this unit is
    member = outer.next()
    if member is None:
        raise tarfile.ReadError(f"no member at offset {unit.index}")
    yield from _member_items(outer, member, url, max_bytes)


def _expand(unit: Unit, max_bytes: int | None = None,
            allowed_roots: tuple[str, ...] | None = None) -> Iterator[SourceItem]:
    url, labels = unit.uris[0], unit.labels[0]
    refused = tar._refused(url, labels, allowed_roots)
    if refused is not None:
        yield refused
        return
    try:
        with fsspec.open(url, "rb") as raw:
            yield from _members(raw, unit, max_bytes)
    except (tarfile.TarError, EOFError, OSError, ValueError, BadImage) as exc:
        yield SourceItem(text_uri(f"{url}#offset={unit.index}"), text_labels(labels), error=("corrupt_archive", text_uri(
            f"{url}: archive unreadable at offset {unit.index} ({type(exc).__name__}: {exc}); the rest of it is skipped"
        )))


READER = Reader(NAME, detect=_detect, plan=_plan, expand=_expand)
