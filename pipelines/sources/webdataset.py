"""WebDataset shards: tar archives whose members are grouped into samples by key.

A sample is the run of consecutive members that share a key, the member name up to the first dot
of its base name (``000123.jpg``, ``000123.cls``, ``000123.json``), as the ``webdataset`` package
groups them. Its image is the ``jpg``, ``jpeg``, ``png`` or ``webp`` member; its label is the
integer in ``.cls``, or, when the sample has none or ``--label-key`` names one, that field of
``.json`` (default ``label``). A negative class id (the convention for "no label") leaves the sample
unlabelled; so does a sample with neither, unless ``--label-key`` was given (then it is
``bad_label``: a field the command names and the sample lacks is a mistake, not a missing label). Sidecars are never items: a sample is one input, and one without an image is
quarantined as ``sample_without_image``.

A source is one shard, a folder of them (split by timm's ``_info.json`` when it has one; the
ingest compares the split's stated ``num_samples`` with what it read), a brace
pattern ``name-{000000..000127}.tar`` or a ``::``-joined list of shards. Shards stream member by
member; only the sample being read is held.
"""
from __future__ import annotations

import json
import logging
import posixpath
import re
import tarfile
from typing import Iterator

import fsspec

from common.fs import url_to_fs
from pipelines.decode import BadImage
from pipelines.schema import text_uri
from pipelines.sources import tar
from pipelines.sources.base import (
    PlanOptions,
    Reader,
    SourceError,
    SourceItem,
    Unit,
    is_hidden,
    text_labels,
    too_large_detail,
)

log = logging.getLogger(__name__)

NAME = "webdataset"
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
LABEL_EXTS = ("cls", "json")
INFO_FILES = ("_info.json", "info.json")
DEFAULT_LABEL_KEY = "label"
_PEEK_MEMBERS = 32
_BRACE = re.compile(r"\{([^{}]*)\}")


# -- shard lists --------------------------------------------------------------------------------

def expand_braces(text: str) -> list[str]:
    """``a-{000..002}.tar`` -> ``a-000.tar a-001.tar a-002.tar``; ``{x,y}`` lists too (``braceexpand``'s rules)."""
    m = _BRACE.search(text)
    if m is None:
        return [text]
    body = m.group(1)
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi = rng.groups()
        width = len(lo) if len(lo) > 1 and lo.startswith("0") else 0
        choices = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    elif "," in body:
        choices = body.split(",")
    else:
        return [text]
    return [out for c in choices for out in expand_braces(text[:m.start()] + c + text[m.end():])]


def shard_urls(source: str) -> list[str] | None:
    """The shards a brace pattern or a ``::``-joined list names, or None when ``source`` is neither.

    fsspec chains (``tar://member::file:///a.tar``, ``simplecache::s3://...``) are not lists: a list
    is one whose every part is an archive.
    """
    parts = [p for part in source.split("::") for p in expand_braces(part)]
    if len(parts) < 2 and parts == [source]:
        return None
    if any(p.startswith("tar://") or not tar.is_tar(p) for p in parts) and "::" in source:
        return None
    return parts


# -- detection ---------------------------------------------------------------------------------

def split_name(name: str) -> tuple[str, str]:
    """(key, extension) of a member, as ``webdataset`` splits it: the key ends at the base name's first dot."""
    folder, base = posixpath.split(name)
    stem, dot, ext = base.partition(".")
    return posixpath.join(folder, stem), ext.lower() if dot else ""


def looks_like_shard(url: str) -> bool:
    """Whether the first members of archive ``url`` pair an image with another member of its key."""
    exts: dict[str, set[str]] = {}
    try:
        with fsspec.open(url, "rb") as raw, tarfile.open(fileobj=raw, mode="r|*") as archive:
            for n, member in enumerate(archive):
                if n >= _PEEK_MEMBERS:
                    break
                key, ext = split_name(member.name)
                found = exts.setdefault(key, set())
                found.add(ext)
                if found & set(IMAGE_EXTS) and found - set(IMAGE_EXTS):
                    return True
    except Exception:  # noqa: BLE001 - an unreadable archive is for the tar reader to quarantine
        return False
    return False


def _detect(fs, path: str) -> bool:
    if not fs.isdir(path):
        return tar.is_tar(path) and looks_like_shard(fs.unstrip_protocol(path))
    entries = [e for e in fs.ls(path, detail=True) if not is_hidden(posixpath.basename(e["name"]))]
    if any(e["type"] == "directory" for e in entries):
        return False
    shards = sorted(e["name"] for e in entries if tar.is_tar(e["name"]))
    return bool(shards) and looks_like_shard(fs.unstrip_protocol(shards[0]))


# -- planning ----------------------------------------------------------------------------------

def _info(fs, root: str) -> dict | None:
    for name in INFO_FILES:
        if fs.exists(f"{root}/{name}"):
            try:
                with fs.open(f"{root}/{name}", "rt") as f:
                    return json.load(f)
            except (OSError, ValueError) as exc:
                raise SourceError(f"{fs.unstrip_protocol(root)}/{name}: not readable JSON ({exc}); "
                                  "fix or remove it") from None
    return None


def _split_entry(source: str, splits: dict, split: str | None) -> tuple[str, dict]:
    """(name, entry) of the split read from an ``_info.json``'s ``splits`` (timm's layout)."""
    if split is None and len(splits) == 1:
        split = next(iter(splits))
    if split is None or split not in splits:
        what = "holds" if split is None else f"has no split {split!r}; it holds"
        raise SourceError(f"{source}: its _info.json {what} the splits {', '.join(splits)}; "
                          "pass --split NAME to read one")
    return split, splits[split]


def stated_samples(source: str, split: str | None) -> tuple[str, int] | None:
    """(split, samples) when ``source`` is a folder whose ``_info.json`` states the size of the split
    read (timm's ``num_samples``), else None."""
    if shard_urls(source) is not None:
        return None
    try:
        fs, root = url_to_fs(source)
        root = root.rstrip("/") or "/"
        if not fs.isdir(root):
            return None
        info = _info(fs, root)
        if not isinstance(info, dict) or not isinstance(info.get("splits"), dict) or not info["splits"]:
            return None
        name, entry = _split_entry(source, info["splits"], split)
    except (SourceError, OSError, ValueError):  # a check that warns never refuses a run its plan read
        return None
    n = entry.get("num_samples") if isinstance(entry, dict) else None
    return (name, n) if isinstance(n, int) and not isinstance(n, bool) else None


def _folder_shards(source: str, fs, root: str, split: str | None) -> list[str]:
    info = _info(fs, root)
    if info and info.get("splits"):
        _, entry = _split_entry(source, info["splits"], split)
        return [fs.unstrip_protocol(f"{root}/{name}") for name in entry.get("filenames", ())]
    shards = sorted(p for p in fs.ls(root, detail=False) if tar.is_tar(p) and not is_hidden(posixpath.basename(p)))
    if split is not None:
        shards = [p for p in shards if split in re.split(r"[-_.]", posixpath.basename(p))]
        if not shards:
            raise SourceError(f"{source}: no shard has {split!r} in its name; pass a --split its shards are named by")
    return [fs.unstrip_protocol(p) for p in shards]


def _plan(source: str, fs, path: str, files_per_unit: int, options: PlanOptions | None = None) -> list[Unit]:
    options = options or PlanOptions()
    urls = _folder_shards(source, fs, path, options.split) if fs.isdir(path) else [fs.unstrip_protocol(path)]
    key = (options.label_key,) if options.label_key else ()
    return [Unit(NAME, (url,), (key,)) for url in urls]


# -- reading -----------------------------------------------------------------------------------

def _label_of(members: dict[str, bytes], label_key: str | None, where: str) -> tuple[str, ...]:
    """The sample's label names; BadImage ``bad_label`` for a sidecar that does not hold one."""
    if "cls" in members and label_key is None:
        text = members["cls"].decode("utf-8", "replace").strip()
        if not re.fullmatch(r"-?\d+", text):
            raise BadImage("bad_label", f"{where}.cls holds {text[:40]!r}, not an integer class id; "
                                        "put names in a .json sidecar and pass --label-key FIELD")
        return () if int(text) < 0 else (str(int(text)),)
    if "json" not in members:
        if label_key is not None:
            raise BadImage("bad_label", f"{where} has no .json sidecar to take --label-key {label_key!r} from")
        return ()
    try:
        meta = json.loads(members["json"])
    except ValueError as exc:
        raise BadImage("bad_label", f"{where}.json is not valid JSON ({exc})") from None
    if label_key is not None and not (isinstance(meta, dict) and label_key in meta):
        # A named field that is missing is a mistake in the command, not an unlabelled sample.
        fields = ", ".join(map(str, meta)) if isinstance(meta, dict) else type(meta).__name__
        raise BadImage("bad_label", f"{where}.json has no field {label_key!r} (it has: {fields}); "
                                    "pass one of them as --label-key")
    value = meta.get(label_key or DEFAULT_LABEL_KEY) if isinstance(meta, dict) else None
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, (bool, float, dict, list)) for v in values):
        raise BadImage("bad_label", f"{where}.json field {label_key or DEFAULT_LABEL_KEY!r} is {value!r}, "
                                    "not a class id, a name or a list of them; pass --label-key FIELD")
    return tuple(str(v) for v in values if v is not None and v != "" and not (isinstance(v, int) and v < 0))


def _samples(archive, max_bytes: int | None) -> Iterator[tuple[str, dict[str, bytes], dict[str, str]]]:
    """(key, {ext: bytes} of the members read, {ext: member name}) per sample, in archive order.

    Only the first image and the label sidecars are read; a member above ``max_bytes`` is not.
    """
    key, data, names = None, {}, {}
    for member, name in tar.file_members(archive):
        k, ext = split_name(name)
        if k != key and names:
            yield key, data, names
            data, names = {}, {}
        key = k
        names.setdefault(ext, name)
        wanted = ext in LABEL_EXTS or (ext in IMAGE_EXTS and not any(e in data for e in IMAGE_EXTS))
        if wanted and (max_bytes is None or member.size <= max_bytes):
            f = archive.extractfile(member)
            data[ext] = f.read() if f is not None else b""
    if names:
        yield key, data, names


def _item(url: str, key: str, data: dict[str, bytes], names: dict[str, str], label_key: str | None,
          max_bytes: int | None) -> SourceItem:
    image_ext = next((e for e in IMAGE_EXTS if e in names), None)
    uri = text_uri(f"tar://{names[image_ext] if image_ext else key}::{url}")
    try:
        labels = text_labels(_label_of(data, label_key, f"{url}: sample {key}"))
    except BadImage as exc:
        return SourceItem(uri, error=(exc.reason, text_uri(exc.detail)))
    if image_ext is None:
        return SourceItem(uri, labels, error=("sample_without_image", text_uri(
            f"{url}: sample {key} has no jpg, jpeg, png or webp member (it has: {', '.join(sorted(names))})")))
    if image_ext not in data:
        return SourceItem(uri, labels, error=("too_large", too_large_detail(uri, None, max_bytes)))
    return SourceItem(uri, labels, reader=tar._HandOver(data[image_ext], uri))


def _expand(unit: Unit, max_bytes: int | None = None,
            allowed_roots: tuple[str, ...] | None = None) -> Iterator[SourceItem]:
    url = unit.uris[0]
    label_key = unit.labels[0][0] if unit.labels and unit.labels[0] else None
    seen = 0
    try:
        refused = tar._refused(url, (), allowed_roots)
        if refused is not None:
            yield refused
            return
        with fsspec.open(url, "rb") as raw, tarfile.open(fileobj=raw, mode="r|*") as archive:
            for key, data, names in _samples(archive, max_bytes):
                seen += 1
                yield _item(url, key, data, names, label_key, max_bytes)
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        where = f"after {seen} sample(s)" if seen else "before the first sample"
        yield SourceItem(text_uri(url), error=("corrupt_archive", text_uri(
            f"{url}: shard unreadable {where} ({type(exc).__name__}: {exc}); the rest of it is skipped")))


READER = Reader(NAME, detect=_detect, plan=_plan, expand=_expand)
