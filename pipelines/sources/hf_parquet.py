"""Hugging Face ``datasets`` Parquet files: the images are in the file, one row each.

The image column is the ``Image`` feature of the file's ``huggingface`` schema metadata (else a
column named ``image`` or ``img``, else the first struct ``{bytes, path}`` or binary column). The
label is the ``--label-key`` column (default ``label``): a ``ClassLabel`` integer becomes its class
name from the same metadata, so the label map holds names in the dataset's own id order; -1 (a
split without labels) leaves a row unlabelled. A source is a file, or a folder of them; a folder
of several splits (``train-*.parquet``, ``validation-*.parquet``) is read one ``--split`` at a
time. A Parquet file with a ``uri`` column is a manifest (:mod:`pipelines.sources.manifest`).

Units are row groups, read one at a time: memory follows a row group, not the file.
"""
from __future__ import annotations

import contextlib
import json
import posixpath
from typing import Iterator

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from common.fs import local_target
from pipelines.schema import text_uri
from pipelines.sources import tar
from pipelines.sources.base import (
    PlanOptions,
    Reader,
    SourceError,
    SourceItem,
    Unit,
    has_suffix,
    is_hidden,
    too_large_detail,
)

NAME = "hf_parquet"
DEFAULT_LABEL_KEY = "label"
_IMAGE_NAMES = ("image", "img")
_NOT_PARQUET = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", *tar.SUFFIXES)


def _features(schema: pa.Schema) -> dict:
    """The ``datasets`` features of a file, from its ``huggingface`` schema metadata ({} without it)."""
    raw = (schema.metadata or {}).get(b"huggingface")
    try:
        info = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    features = info.get("info", {}).get("features", {}) if isinstance(info, dict) else {}
    return features if isinstance(features, dict) else {}


def _is_image_type(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or (
        pa.types.is_struct(t) and any(t.field(i).name == "bytes" for i in range(t.num_fields)))


def image_column(schema: pa.Schema) -> str | None:
    features = _features(schema)
    typed = [name for name, f in features.items() if isinstance(f, dict) and f.get("_type") == "Image"]
    named = [n for n in _IMAGE_NAMES if n in schema.names and _is_image_type(schema.field(n).type)]
    shaped = [f.name for f in schema if _is_image_type(f.type)]
    return next(iter(typed + named + shaped), None)


def _schema(fs, path: str) -> pa.Schema:
    with fs.open(path, "rb") as f:
        return pq.read_schema(f)


def _parquet_files(fs, root: str) -> list[str]:
    return sorted(p for p in fs.find(root) if p.lower().endswith(".parquet") and not is_hidden(p[len(root):]))


def _detect(fs, path: str) -> bool:
    try:
        if not fs.isdir(path):
            return has_suffix(path, (".parquet",)) and _readable_as_images(_schema(fs, path))
        first = None
        for top, _, names in fs.walk(path):  # stops at the first image: an image tree is not listed twice
            if any(has_suffix(n, _NOT_PARQUET) for n in names):
                return False
            found = sorted(n for n in names if n.lower().endswith(".parquet"))
            first = first or (f"{top}/{found[0]}" if found else None)
        return first is not None and _readable_as_images(_schema(fs, first))
    except Exception:  # noqa: BLE001 - a file that cannot be read is another reader's to refuse
        return False


def _readable_as_images(schema: pa.Schema) -> bool:
    return "uri" not in schema.names and image_column(schema) is not None


def split_of(path: str) -> str:
    """A file's split: ``train`` for ``train-00000-of-00004.parquet``, else the folder it is in."""
    base = posixpath.basename(path)
    return base.split("-", 1)[0] if "-" in base else posixpath.basename(posixpath.dirname(path))


def _chosen_files(source: str, fs, path: str, split: str | None) -> list[str]:
    if not fs.isdir(path):
        return [path]
    files = _parquet_files(fs, path)
    splits = sorted({split_of(p) for p in files})
    if split is None and len(splits) > 1:
        raise SourceError(f"{source}: holds the splits {', '.join(splits)}; pass --split NAME to read one")
    if split is not None:
        files = [p for p in files if split_of(p) == split]
        if not files:
            raise SourceError(f"{source}: has no split {split!r} (it holds {', '.join(splits)}); pass one of them")
    return files


def _file_units(fs, path: str, options: PlanOptions) -> list[Unit]:
    url = fs.unstrip_protocol(path)
    with fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        schema, groups = pf.schema_arrow, pf.num_row_groups
    image = image_column(schema)
    label = options.label_key or DEFAULT_LABEL_KEY
    if image is None:
        raise SourceError(f"{url}: no image column (columns: {', '.join(schema.names)}); a Hugging Face Parquet "
                          "file holds an Image feature or a {bytes, path} column")
    if label not in schema.names:
        if options.label_key:
            raise SourceError(f"{url}: no column {label!r} (columns: {', '.join(schema.names)}); "
                              "pass the label column as --label-key")
        label = ""
    feature = _features(schema).get(label) or {}
    names = tuple(str(n) for n in feature.get("names", ())) if feature.get("_type") == "ClassLabel" else ()
    return [Unit(NAME, (url,), (names, (image,), (label,)), index=g) for g in range(groups)]


def _plan(source: str, fs, path: str, files_per_unit: int, options: PlanOptions | None = None) -> list[Unit]:
    options = options or PlanOptions()
    return [u for p in _chosen_files(source, fs, path, options.split) for u in _file_units(fs, p, options)]


def class_names(units: list[Unit]) -> tuple[str, ...] | None:
    """The ``ClassLabel`` names every unit declares, when all are Hugging Face units that agree; else None."""
    declared = {u.labels[0] for u in units if u.kind == NAME}
    if not units or any(u.kind != NAME for u in units) or len(declared) != 1:
        return None
    return next(iter(declared)) or None


# -- reading -----------------------------------------------------------------------------------

def _labels(value, names: tuple[str, ...], where: str) -> tuple[str, ...]:
    values = value if isinstance(value, list) else [value]
    out = []
    for v in values:
        if v is None or (isinstance(v, int) and v < 0):
            continue
        if isinstance(v, int) and names and v >= len(names):
            raise ValueError(f"{where}: label {v} is past the {len(names)} ClassLabel names in the file's metadata")
        out.append(names[v] if isinstance(v, int) and names else str(v))
    return tuple(text_uri(n) for n in out)


def _row_item(row: dict, image: str, label: str, names: tuple[str, ...], uri: str,
              max_bytes: int | None) -> SourceItem:
    try:
        labels = _labels(row.get(label) if label else None, names, uri)
    except ValueError as exc:
        return SourceItem(uri, error=("bad_label", text_uri(str(exc))))
    value = row[image]
    data = value.get("bytes") if isinstance(value, dict) else value
    if not data:
        path = value.get("path") if isinstance(value, dict) else None
        return SourceItem(uri, labels, error=("unreadable", text_uri(
            f"{uri}: the image holds no bytes" + (f", only the path {path!r}" if path else "")
            + "; write the Parquet files with the images embedded (datasets' push_to_hub or to_parquet do)")))
    if max_bytes is not None and len(data) > max_bytes:
        return SourceItem(uri, labels, error=("too_large", too_large_detail(uri, len(data), max_bytes)))
    return SourceItem(uri, labels, data=data)


def _expand(unit: Unit, max_bytes: int | None = None,
            allowed_roots: tuple[str, ...] | None = None) -> Iterator[SourceItem]:
    url, (names, (image,), (label,)) = unit.uris[0], unit.labels
    refused = tar._refused(url, (), allowed_roots)
    if refused is not None:
        yield refused
        return
    local = local_target(url) if "::" not in url else None
    try:
        # A local file through Arrow's own reader: no Python file object between it and the pages.
        with (contextlib.nullcontext(local) if local is not None else fsspec.open(url, "rb")) as f:
            pf = pq.ParquetFile(f)
            row = sum(pf.metadata.row_group(g).num_rows for g in range(unit.index))
            columns = [image] + ([label] if label else [])
            for batch in pf.iter_batches(batch_size=64, row_groups=[unit.index], columns=columns):
                for values in batch.to_pylist():
                    yield _row_item(values, image, label, names, text_uri(f"{url}#row={row}"), max_bytes)
                    row += 1
    except (OSError, ValueError, pa.ArrowException) as exc:
        yield SourceItem(text_uri(f"{url}#row_group={unit.index}"), error=("unreadable", text_uri(
            f"{url}: row group {unit.index} unreadable ({type(exc).__name__}: {exc}); the rest of it is skipped")))


READER = Reader(NAME, detect=_detect, plan=_plan, expand=_expand)
