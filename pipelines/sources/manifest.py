"""A manifest (``.csv``, ``.jsonl``/``.ndjson``, ``.parquet``), JFT-style: a ``uri`` column and a
``label`` (one) or ``labels`` (several: a list, a JSON list string, or names joined by ``|``)
column. Relative uris are resolved against the manifest's folder. It plans ``files`` units, and
one unit with an error for each row that names no file."""
from __future__ import annotations

import csv
import json
import posixpath
from typing import Iterator

import pyarrow.parquet as pq

from common.fs import irregular_file
from pipelines.sources.base import FileBatcher, Reader, SourceError, Unit, has_suffix

SUFFIXES = (".csv", ".jsonl", ".ndjson", ".parquet")


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


def _jsonl_rows(f) -> Iterator[dict]:
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = {"__error__": f"line {lineno} is not valid JSON"}
        yield row if isinstance(row, dict) else {"__error__": f"line {lineno} is not a JSON object"}


def _rows(fs, path: str) -> Iterator[dict]:
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
                yield from _jsonl_rows(f)
    except Exception as exc:
        raise SourceError(f"{fs.unstrip_protocol(path)}: cannot read manifest ({type(exc).__name__}: {exc})") from None


def _check_columns(row: dict, manifest_url: str) -> None:
    if "uri" not in row:
        raise SourceError(
            f"{manifest_url}: manifest has no 'uri' column (columns: {', '.join(map(str, row))}); "
            "name the image column 'uri' and the label column 'label' or 'labels'"
        )


def _plan(source: str, fs, path: str, files_per_unit: int, options=None) -> list[Unit]:
    manifest_url = fs.unstrip_protocol(path)
    why = irregular_file(manifest_url)
    if why:
        raise SourceError(f"{source}: {why}, not a manifest file; pass a regular file")
    base = posixpath.dirname(path)
    units: list[Unit] = []
    files = FileBatcher(units, files_per_unit)
    columns_checked = False
    for n, row in enumerate(_rows(fs, path)):
        if not columns_checked and "__error__" not in row:
            _check_columns(row, manifest_url)
            columns_checked = True
        uri = row.get("uri")
        if "__error__" in row or not isinstance(uri, str) or not uri.strip():
            why = row.get("__error__") or f"row {n} has no uri"
            files.flush()  # keep manifest order
            units.append(Unit("files", (f"{manifest_url}#row={n}",), error=("bad_manifest_row", f"{manifest_url}: {why}")))
            continue
        uri = uri.strip()
        if "://" not in uri and "::" not in uri:
            uri = fs.unstrip_protocol(uri if uri.startswith("/") else posixpath.normpath(posixpath.join(base, uri)))
        labels = _parse_labels(row["labels"], multi=True) if "labels" in row else _parse_labels(row.get("label"), multi=False)
        files.add(uri, labels)
    files.flush()
    return units


READER = Reader("manifest", detect=lambda fs, path: has_suffix(path, SUFFIXES), plan=_plan)
