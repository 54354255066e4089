"""The shard format: the one definition that the Beam writer and the training readers share.

A shard set is a directory::

    DIR/manifest.json        written last, atomically: its presence means the run completed
    DIR/shard-00000.arrow    Arrow IPC *file* format (random access), rows sorted by ``key``
    DIR/shard-00001.arrow    ...
    DIR/quarantine.jsonl     one row per rejected input: uri, reason, detail
    DIR/duplicates.jsonl     one row per dropped duplicate (corpus or test set)
    DIR/removed.jsonl        optional: keys to skip when reading (written by the dedup job)

Columns (:data:`SCHEMA`, version :data:`SCHEMA_VERSION`):

``key``           string   stable id of the item, derived from its source uri (:func:`make_key`)
``image``         binary   the pixels: JPEG bytes, or raw uint8 HxWx3 when ``format == "raw"``
``format``        string   ``"jpeg"`` or ``"raw"``
``height``        int32    pixel height of ``image``
``width``         int32    pixel width of ``image``
``labels``        list<int32>  class ids through ``manifest["label_map"]``; several for multi-label corpora
``source``        string   the uri the item was read from (tar members: ``tar://member::archive-url``);
                           bytes of a file name that are not UTF-8 appear as ``\\xNN`` (:func:`text_uri`)
``content_hash``  string   SHA-256 of the decoded pixels, ``neardup.signatures.content_hash`` (large
                           JPEGs are hashed as decoded at the DCT-draft scale for ``--size``)
``phash``         binary   perceptual signatures, ``neardup.signatures.corpus_codes`` of the decoded image

``manifest.json`` holds ``schema_version``, ``shards`` (``path`` relative to DIR,
``rows``, ``bytes``, ``sha256``; sorted by path), ``num_rows``, ``label_map``
(name -> id), ``counts`` (``inputs``, ``written``, ``rejected`` per reason,
``duplicates`` per cause: ``corpus`` and one entry per test set) with
``inputs == written + sum(rejected) + sum(duplicates)``, the ``config`` and the
``mlflow_run_id``.

``removed.jsonl``: one JSON object per line with at least ``"key"`` (the dedup job adds the
match and its ``mlflow_run_id``) (a bare
JSON string is accepted too). :class:`ShardSet` skips those rows in
``len()``, indexing and :meth:`ShardSet.iter_batches`, so a later dedup pass
can drop items without rewriting shards. ``open_shard`` still returns the
whole shard file, as written and checksummed.
"""
from __future__ import annotations

import bisect
import hashlib
import io
import json
import logging
import os
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
from PIL import Image

# The source column's text contract: names that are not UTF-8 are written with \xNN escapes.
from common.config import InputError
from common.fs import TMP_MARKER, atomic_write, is_local, shard_verify_default, url_to_fs  # noqa: F401  (TMP_MARKER: part of the layout)
from common.text import utf8_text as text_uri

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

KEY = "key"
IMAGE = "image"
FORMAT = "format"
HEIGHT = "height"
WIDTH = "width"
LABELS = "labels"
SOURCE = "source"
CONTENT_HASH = "content_hash"
PHASH = "phash"
COLUMNS = (KEY, IMAGE, FORMAT, HEIGHT, WIDTH, LABELS, SOURCE, CONTENT_HASH, PHASH)

FORMATS = ("jpeg", "raw")

SCHEMA = pa.schema(
    [
        pa.field(KEY, pa.string(), nullable=False),
        pa.field(IMAGE, pa.binary(), nullable=False),
        pa.field(FORMAT, pa.string(), nullable=False),
        pa.field(HEIGHT, pa.int32(), nullable=False),
        pa.field(WIDTH, pa.int32(), nullable=False),
        pa.field(LABELS, pa.list_(pa.int32()), nullable=False),
        pa.field(SOURCE, pa.string(), nullable=False),
        pa.field(CONTENT_HASH, pa.string(), nullable=False),
        pa.field(PHASH, pa.binary(), nullable=False),
    ],
    metadata={"vitscale.schema_version": str(SCHEMA_VERSION)},
)

MANIFEST = "manifest.json"
QUARANTINE = "quarantine.jsonl"
DUPLICATES = "duplicates.jsonl"
REMOVED = "removed.jsonl"
# Written by the dedup job (dedup.rescan): which shards were checked against which test sets, and
# the dedup runs that did it (``runs``).
DEDUP_STATE = "dedup_state.json"
SHARD_PATTERN = "shard-{index:05d}.arrow"

# Rows per record batch inside a shard: small enough that streaming a shard
# does not pull it all into memory, large enough to keep per-batch overhead low.
BATCH_ROWS = 1024


class ShardSetError(InputError):
    """A shard set that cannot be read as it is; the message names the file and the fix."""


def make_key(uri: str) -> str:
    """Stable 20-hex-digit id of an item from its source uri: same input, same key, every run.

    A name and its :func:`text_uri` form give the same key, so re-sharding from
    the ``source`` column keeps every key.
    """
    return hashlib.blake2b(text_uri(uri).encode("utf-8"), digest_size=10).hexdigest()


def shard_name(index: int) -> str:
    return SHARD_PATTERN.format(index=index)


def file_sha256(path: str | os.PathLike, fs=None) -> str:
    h = hashlib.sha256()
    opener = fs.open if fs is not None else open
    with opener(str(path), "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def records_to_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows (dicts with every column) to a table in :data:`SCHEMA`, in the given order."""
    arrays = [pa.array([r[name] for r in rows], type=SCHEMA.field(name).type) for name in COLUMNS]
    return pa.Table.from_arrays(arrays, schema=SCHEMA)


def _removed_lines(path: str, fs) -> tuple[list[str], str | None]:
    """The complete lines of a removal list, and a torn last line (no newline, not JSON) or None.

    A writer killed mid-line (an older vitscale appended through a buffer) leaves such a
    tail. Its removal never completed: the dedup state is written after the list, so the
    next dedup run finds that match again. The tail is skipped, never guessed at.
    """
    with fs.open(path, "rb") as f:
        text = f.read().decode("utf-8")
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends with a newline
    if tail.strip():
        try:
            json.loads(tail)
        except json.JSONDecodeError:
            return lines, tail
        lines.append(tail)
    return lines, None


def read_removed(directory: str | os.PathLike, fs=None) -> frozenset[str]:
    """Keys listed in ``DIR/removed.jsonl`` (empty if the file is absent).

    A torn last line is skipped with a warning (:func:`_removed_lines`); a bad line
    anywhere else is an error.
    """
    fs, root = url_to_fs(directory, fs)
    path = f"{root}/{REMOVED}"
    if not fs.exists(path):
        return frozenset()
    keys = set()
    lines, torn = _removed_lines(path, fs)
    if torn is not None:
        log.warning("%s: its last line is torn (%d bytes, no newline; a write was cut off) and is skipped; "
                    "the next dedup run rewrites the file without it", path, len(torn))
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ShardSetError(f"{path}:{lineno}: not valid JSON ({exc}); fix or delete the line") from None
        key = obj.get(KEY) if isinstance(obj, dict) else obj
        if not isinstance(key, str):
            raise ShardSetError(f'{path}:{lineno}: expected {{"key": "..."}} or a JSON string, got {line[:80]!r}')
        keys.add(key)
    return frozenset(keys)


def append_removed(directory: str | os.PathLike, rows: Sequence[Mapping[str, Any]], fs=None) -> None:
    """Add ``rows`` to ``DIR/removed.jsonl`` atomically: the whole file is rewritten and renamed,
    so a reader sees the old list or the new one, never a torn line. A torn tail left by an
    older writer is dropped in the rewrite (no ``rows``: only that repair, if needed)."""
    fs, root = url_to_fs(directory, fs)
    path = f"{root}/{REMOVED}"
    lines, torn = _removed_lines(path, fs) if fs.exists(path) else ([], None)
    if not rows and torn is None:
        return
    text = "".join(line + "\n" for line in lines if line.strip())
    text += "".join(json.dumps(dict(r)) + "\n" for r in rows)
    atomic_write(path, text, fs)


def _check_inside(name: Any, manifest: str) -> None:
    """A shard path from a manifest must name a file inside the shard set's directory: a
    relative path with no ``..``, so that a crafted manifest cannot make a reader open (or a
    job overwrite) files elsewhere."""
    parts = name.replace("\\", "/").split("/") if isinstance(name, str) else [""]
    if (not isinstance(name, str) or not name or name.startswith(("/", "\\")) or ":" in parts[0]
            or "://" in name or ".." in parts):
        raise ShardSetError(
            f"{manifest}: shard path {name!r} is not a relative path inside the shard set; "
            "a manifest may name only files under its own directory (re-run prepare)"
        )


def missing_manifest_hint(directory: str | os.PathLike) -> str:
    """What to run when ``directory`` has no manifest, with paths that ``prepare`` accepts.

    A folder of source data cannot be its own ``--output`` (prepare refuses an output inside
    an input), so the suggestion for one is a sibling folder.
    """
    fs, root = url_to_fs(directory)
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)] if fs.isdir(root) else []
    except OSError:
        names = []
    data = [n for n in names if not n.startswith(".") and not n.startswith("shard-")
            and n not in (QUARANTINE, DUPLICATES, REMOVED, DEDUP_STATE)]
    if data:
        target = f"{str(directory).rstrip('/')}-shards"
        return (f"it looks like source data, not a shard set; ingest it with jobs/prepare.py --input {directory} "
                f"--output {target}, then pass {target}")
    return (f"this is not a shard set or the prepare run did not complete; run jobs/prepare.py --input SOURCE "
            f"--output {directory}")


# Shards this process has hashed and found right: (path, manifest sha256) -> the file's identity
# (size, mtime, inode) then. A ShardSet made again for the same files (a read task, a new
# epoch's loader) does not hash them again unless they changed.
_VERIFIED: dict[tuple[str, str], tuple] = {}


class ShardSet:
    """Read a shard set written by ``prepare``: memory-mapped random access and streaming.

    Args:
        directory: the shard set directory (local path or fsspec URL). Local shards
            are memory-mapped; remote ones are read into memory when opened.
        honour_removed: skip the keys listed in ``removed.jsonl`` (default True).
        verify: check each shard's sha256 against the manifest before its first read in
            this process, so that a corrupt or tampered shard (labels rewritten after
            ``prepare``) fails with a clear error instead of being trained on. Default: on,
            unless ``VITSCALE_SKIP_SHARD_VERIFY=1``.
        verified: ``{shard index: identity}`` from :meth:`verified_shards` of a copy that
            already checked them (a driver handing shards to its read tasks): an unchanged
            file is not hashed again. A pickled ShardSet carries its own.

    ``len(ss)``/``ss.num_rows`` counts the rows that survive ``removed.jsonl``,
    ``ss[i]`` returns the i-th of them as a dict, and :meth:`iter_batches`
    streams them shard by shard. Tables are opened lazily and the object pickles
    without them, so it can be handed to data-loader workers.
    """

    def __init__(self, directory: str | os.PathLike, *, honour_removed: bool = True, verify: bool | None = None,
                 verified: Mapping[int, tuple] | None = None):
        self.directory = str(directory)
        self._verify = shard_verify_default() if verify is None else verify
        self._verified: dict[int, tuple] = dict(verified or {})
        self._fs, self._root = url_to_fs(directory)
        self._local = is_local(self._fs)
        path = f"{self._root}/{MANIFEST}"
        if not self._fs.exists(path):
            raise ShardSetError(f"{self.directory}: no {MANIFEST}; {missing_manifest_hint(self.directory)}")
        with self._fs.open(path, "rt") as f:
            try:
                self.manifest: dict = json.load(f)
            except json.JSONDecodeError as exc:
                raise ShardSetError(f"{path}: not valid JSON ({exc}); re-run prepare") from None
        version = self.manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ShardSetError(
                f"{path}: schema_version {version!r}, this reader understands {SCHEMA_VERSION}; "
                "re-run prepare with this version of vitscale"
            )
        self.label_map: dict[str, int] = dict(self.manifest.get("label_map", {}))
        self.shards: list[dict] = list(self.manifest["shards"])
        for entry in self.shards:
            _check_inside(entry.get("path") if isinstance(entry, dict) else entry, path)
        self.removed_keys: frozenset[str] = read_removed(self.directory, self._fs) if honour_removed else frozenset()
        self._tables: dict[int, pa.Table] = {}
        self._retained: list[np.ndarray | None] = [None] * len(self.shards)
        if self.removed_keys:
            for i in range(len(self.shards)):
                keys = self.open_shard(i).column(KEY).to_pylist()
                removed = self.removed_keys
                self._retained[i] = np.fromiter(
                    (j for j, k in enumerate(keys) if k not in removed), dtype=np.int64
                )
        counts = [
            int(s["rows"]) if r is None else len(r) for s, r in zip(self.shards, self._retained)
        ]
        self._offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()

    # -- metadata ---------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return int(self._offsets[-1])

    def __len__(self) -> int:
        return self.num_rows

    @property
    def label_names(self) -> list[str]:
        """Label names indexed by id."""
        names = [""] * (max(self.label_map.values(), default=-1) + 1)
        for name, idx in self.label_map.items():
            names[idx] = name
        return names

    def shard_path(self, i: int) -> str:
        return f"{self._root}/{self.shards[i]['path']}"

    # -- access -----------------------------------------------------------------------------
    def open_shard(self, i: int) -> pa.Table:
        """Shard ``i`` as a whole ``pa.Table`` (memory-mapped for local files; no removal applied)."""
        table = self._tables.get(i)
        if table is None:
            path = self.shard_path(i)
            if self._verify:
                self._ensure_verified(i)
            try:
                if self._local:
                    source = pa.memory_map(os.fsencode(path), "r")  # bytes: a folder name need not be UTF-8
                else:
                    with self._fs.open(path, "rb") as f:
                        source = pa.BufferReader(f.read())
                table = ipc.open_file(source).read_all()
            except FileNotFoundError:
                raise ShardSetError(f"{self.shards[i]['path']}: listed in the manifest but missing; re-run prepare") from None
            except pa.ArrowInvalid as exc:
                raise ShardSetError(f"{self.shards[i]['path']}: not a readable Arrow IPC file ({exc}); re-run prepare") from None
            self._tables[i] = table
        return table

    def retained_rows(self, i: int) -> np.ndarray:
        """Row indices of shard ``i`` that survive ``removed.jsonl``."""
        r = self._retained[i]
        return np.arange(int(self.shards[i]["rows"])) if r is None else r

    def iter_batches(
        self,
        shard_indices: Sequence[int] | None = None,
        *,
        columns: Sequence[str] | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """Stream record batches shard by shard, in manifest order, skipping removed keys."""
        for i in range(len(self.shards)) if shard_indices is None else shard_indices:
            table = self.open_shard(i)
            if columns is not None:
                table = table.select(list(columns))
            retained = self._retained[i]
            if retained is not None:
                table = table.take(pa.array(retained))
            yield from table.to_batches(max_chunksize=BATCH_ROWS)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < 0:
            index += self.num_rows
        if not 0 <= index < self.num_rows:
            raise IndexError(f"row {index} out of range for a shard set of {self.num_rows} rows")
        shard = bisect.bisect_right(self._offsets, index) - 1
        local = index - self._offsets[shard]
        retained = self._retained[shard]
        if retained is not None:
            local = int(retained[local])
        return self.open_shard(shard).slice(local, 1).to_pylist()[0]

    def verify(self) -> None:
        """Check every shard's size, sha256 and row count against the manifest; raise on the first mismatch."""
        for i, entry in enumerate(self.shards):
            path = self.shard_path(i)
            name = entry["path"]
            if not self._fs.exists(path):
                raise ShardSetError(f"{name}: listed in the manifest but missing; re-run prepare")
            ident = self._identity(i)
            self._check_sha256(i)
            if ident is not None:
                self._verified[i] = _VERIFIED[(path, entry["sha256"])] = ident
            rows = self.open_shard(i).num_rows
            if rows != int(entry["rows"]):
                raise ShardSetError(f"{name}: {rows} rows, manifest says {entry['rows']}; re-run prepare")

    def _identity(self, i: int) -> tuple | None:
        path = self.shard_path(i)
        try:
            if self._local:
                st = os.stat(os.fsencode(path))
                return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
            info = self._fs.info(path)
        except FileNotFoundError:
            return None
        stamp = next((info[k] for k in ("mtime", "LastModified", "updated", "ETag", "etag") if info.get(k)), None)
        return (info.get("size"), str(stamp)) if stamp is not None else None

    def _ensure_verified(self, i: int) -> None:
        """Hash shard ``i`` unless this copy or this process already found the unchanged file right."""
        ident = self._identity(i)
        key = (self.shard_path(i), self.shards[i]["sha256"])
        if ident is not None and ident in (self._verified.get(i), _VERIFIED.get(key)):
            self._verified[i] = ident
            return
        self._check_sha256(i)
        if ident is not None:
            self._verified[i] = _VERIFIED[key] = ident

    @property
    def verifies(self) -> bool:
        """Whether this copy checks each shard's sha256 before its first read."""
        return self._verify

    def verified_shards(self) -> dict[int, tuple]:
        """The shards this copy has checked, for ``ShardSet(..., verified=...)`` in another process."""
        return dict(self._verified)

    def verify_shards(self, shard_indices: Sequence[int] | None = None) -> None:
        """Check the sha256 of these shards (default: all) now, unless already done for unchanged files."""
        for i in range(len(self.shards)) if shard_indices is None else shard_indices:
            self._ensure_verified(i)

    def _check_sha256(self, i: int) -> None:
        entry = self.shards[i]
        try:
            actual = file_sha256(self.shard_path(i), self._fs)
        except FileNotFoundError:
            raise ShardSetError(f"{entry['path']}: listed in the manifest but missing; re-run prepare") from None
        if actual != entry["sha256"]:
            raise ShardSetError(
                f"{entry['path']}: sha256 mismatch (manifest says {entry['sha256'][:12]}…, file has {actual[:12]}…); "
                "re-run prepare"
            )

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_tables"] = {}
        return state


def decode_row_image(
    row_or_bytes: Mapping[str, Any] | bytes,
    format: str | None = None,
    height: int | None = None,
    width: int | None = None,
) -> np.ndarray:
    """The pixels of one shard row as a writable ``uint8`` array of shape (H, W, 3).

    Pass a row dict (from ``ShardSet[i]`` or ``to_pylist()``), or the ``image``
    bytes together with ``format`` and, for raw storage, ``height`` and ``width``.
    """
    if isinstance(row_or_bytes, Mapping):
        data = row_or_bytes[IMAGE]
        format = format or row_or_bytes[FORMAT]
        height = height or row_or_bytes[HEIGHT]
        width = width or row_or_bytes[WIDTH]
    else:
        data = row_or_bytes
    if format == "raw":
        if not height or not width:
            raise ValueError("decode_row_image: raw images need height and width (pass the row, or both sizes)")
        expected = int(height) * int(width) * 3
        if len(data) != expected:
            raise ValueError(f"decode_row_image: raw image has {len(data)} bytes, {height}x{width}x3 needs {expected}")
        return np.frombuffer(data, dtype=np.uint8).reshape(int(height), int(width), 3).copy()
    if format == "jpeg":
        with Image.open(io.BytesIO(data)) as img:
            img = img.convert("RGB") if img.mode != "RGB" else img
            arr = np.asarray(img)
        if (height and arr.shape[0] != height) or (width and arr.shape[1] != width):
            raise ValueError(f"decode_row_image: JPEG is {arr.shape[0]}x{arr.shape[1]}, row says {height}x{width}")
        return arr if arr.flags.writeable else arr.copy()
    raise ValueError(f"decode_row_image: unknown format {format!r}; expected one of {FORMATS}")


def content_sha256(manifest: dict, removed: Any = ()) -> str:
    """The digest of what a shard set holds: each shard's name and sha256, the label map and the rows
    de-duplication removed. The manifest file itself also names the prepare run that wrote it, so
    every re-ingest of the same images gets a new manifest digest but the same content digest."""
    content = {"shards": sorted((s["path"], s["sha256"]) for s in manifest.get("shards", [])),
               "label_map": sorted((manifest.get("label_map") or {}).items()),
               "removed": sorted(str(k) for k in removed)}
    return hashlib.sha256(json.dumps(content, separators=(",", ":")).encode()).hexdigest()


def shard_set_record(directory: str | os.PathLike, *, role: str | None = None) -> dict[str, Any]:
    """What a run that reads this shard set records about it (``common.tracking.run_tags`` and
    ``log_shard_inputs``): its name and URL, the sha256 of its manifest, the prepare run that wrote
    it, the dedup runs that checked it, and a one-line de-duplication state such as
    ``"ingest vs digits_test: 3 removed; dedup signature_v3 vs digits_test: 2 removed"`` or ``"none"``.
    """
    fs, root = url_to_fs(directory)
    path = f"{root}/{MANIFEST}"
    with fs.open(path, "rb") as f:
        raw = f.read()
    manifest = json.loads(raw)
    state: dict = {}
    if fs.exists(f"{root}/{DEDUP_STATE}"):
        with fs.open(f"{root}/{DEDUP_STATE}", "rt") as f:
            try:
                state = json.load(f)
            except json.JSONDecodeError:
                state = {}
    removed = read_removed(directory, fs)
    parts = []
    at_ingest = {k: v for k, v in manifest.get("counts", {}).get("duplicates", {}).items() if k != "corpus"}
    if at_ingest:
        parts.append("ingest vs " + ", ".join(sorted(at_ingest)) + f": {sum(at_ingest.values())} removed")
    runs = [r["mlflow_run_id"] for r in state.get("runs", []) if r.get("mlflow_run_id")]
    if state:
        test_sets = sorted({n for entry in state.get("shards", {}).values() for n in entry.get("test_sets", {})})
        parts.append(f"dedup signature_v{state.get('signature_version', '?')}"
                     + (f" vs {', '.join(test_sets)}" if test_sets else "") + f": {len(removed)} removed")
    elif removed:
        parts.append(f"{len(removed)} removed by {REMOVED}")
    name = os.path.basename(str(directory).rstrip("/")) or str(directory)
    return {
        "name": name, "url": fs.unstrip_protocol(root), "role": role,
        "manifest_sha256": hashlib.sha256(raw).hexdigest(),
        "content_sha256": content_sha256(manifest, removed),
        "num_rows": manifest.get("num_rows"),
        "prepare_run_id": manifest.get("mlflow_run_id") or "",
        "dedup_run_ids": runs,
        "dedup_state": "; ".join(parts) or "none",
    }
