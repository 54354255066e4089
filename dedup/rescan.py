"""Incremental re-check of an existing shard set against the test-set index.

When a test set is added or changed, shards already written may hold
duplicates of it (paper Section 4.1: pre-training data is de-duplicated against
every downstream test set). Rewriting shards is expensive, so matches are
appended to ``removed.jsonl``, which ``pipelines.schema.ShardSet`` honours.

State lives in ``dedup_state.json`` next to the shards: for every shard (by
sha256) the fingerprint of each test set it has been checked against. A run
checks only (shard, test set) pairs whose shard is new or whose test set is new
or changed, so a second run with nothing new does nothing and says so. A change
of the match rule (threshold, signature version, crop variants, inner crops,
blocks: ``neardup.index.rule_id``) invalidates every pair, once, and the summary
says so. Each ``removed.jsonl`` row names the files: the corpus item's
``source`` uri beside its ``key``, the test image's ``test_uri`` beside
``test_set``/``matched_key``, and the ``direction`` that matched.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image

from common.config import InputError
from common.fs import atomic_write
from neardup import signatures as sig
from neardup.index import FORWARD, REVERSE, TestSetIndex
from pipelines import schema
from pipelines.schema import ShardSet, ShardSetError, decode_row_image

STATE = schema.DEDUP_STATE
STATE_FORMAT = 1


@dataclasses.dataclass
class RescanResult:
    shards_total: int
    shards_checked: int
    pairs_checked: int  # (shard, test set) pairs processed this run
    rows_scanned: int
    new_matches: list[dict]
    matches_per_test_set: dict[str, int]
    # set when dedup_state.json was written under another match rule (neardup.index.rule_id):
    # "signature version 2 -> 3" or the like; every shard is then re-checked once
    rule_changed: str | None = None

    @property
    def nothing_new(self) -> bool:
        return self.pairs_checked == 0

    def summary(self) -> str:
        if self.nothing_new:
            return (f"nothing new: all {self.shards_total} shards already checked against every test set "
                    "at this threshold; no changes made")
        per = ", ".join(f"{k}={v}" for k, v in sorted(self.matches_per_test_set.items())) or "none"
        changed = (f"match rule changed since the last check ({self.rule_changed}): re-checked every shard once; "
                   if self.rule_changed else "")
        return (f"{changed}checked {self.pairs_checked} (shard, test set) pairs over {self.shards_checked}/{self.shards_total} "
                f"shards, {self.rows_scanned} rows; {len(self.new_matches)} new removals ({per})")


def _load_state(path: Path, index: TestSetIndex) -> tuple[dict, str | None]:
    fresh = {"format": STATE_FORMAT, "signature_version": sig.SIGNATURE_VERSION,
             "threshold": index.threshold, "rule": index.rule_id(), "shards": {}}
    if not path.exists():
        return fresh, None
    try:
        state = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc}); delete it to re-check every shard") from exc
    if state.get("rule") != index.rule_id():  # another threshold, signature or variant set: re-check all
        old = (state.get("signature_version"), state.get("threshold"))
        new = (sig.SIGNATURE_VERSION, index.threshold)
        what = [f"{label} {a} -> {b}" for label, a, b in zip(("signature version", "threshold"), old, new) if a != b]
        return fresh, ", ".join(what) or f"rule {state.get('rule')} -> {index.rule_id()}"
    return state, None


def _corpus_codes(table: pa.Table, phash: list, current: bool) -> tuple[list[int], np.ndarray]:
    """(rows, codes): the rows that carry near-duplicate codes and their (CORPUS_CODES, SIGNATURE_BYTES) codes.

    From the ``phash`` column where it holds ``signatures.corpus_codes`` of this
    signature version (``current``: the manifest's ``signature_version``; empty:
    a low-texture image, matched by content hash only). Codes of another version
    are recomputed from the stored image (resized by the ingest, which the
    signature tolerates: the calibration's resize transforms): version 5 codes
    have version 6's length but come from another proxy, and shards before
    version 3 hold only the whole-image code, blind to the reverse direction.
    """
    by_row: dict[int, bytes] = {}
    stale = []
    for i, p in enumerate(phash):
        if current and p is not None and len(p) in (0, sig.CORPUS_SIGNATURE_BYTES):
            by_row[i] = p
        else:
            stale.append(i)
    if stale and "image" not in table.column_names:
        raise ShardSetError(f"{len(stale)} rows have no version-{sig.SIGNATURE_VERSION} signature and the shard holds "
                      "no images to recompute it from; re-run the ingest")
    if stale:
        images = table.select([c for c in ("image", "format", "height", "width") if c in table.column_names])
        for i in stale:
            by_row[i] = sig.corpus_codes(Image.fromarray(decode_row_image(images.slice(i, 1).to_pylist()[0])))
    rows = sorted(i for i, p in by_row.items() if p)
    codes = np.frombuffer(b"".join(by_row[i] for i in rows), dtype=np.uint8)
    return rows, codes.reshape(len(rows), sig.CORPUS_CODES, sig.SIGNATURE_BYTES)


def rescan(shard_dir: str | os.PathLike, index: TestSetIndex, *, run_id: str | None = None) -> RescanResult:
    """Match new shards / new test sets of ``shard_dir`` against ``index``; append removals, persist state.

    ``run_id`` (the dedup job's MLflow run) goes with each removal it writes and, when it checked
    anything, into the state's ``runs``: the readers' lineage (``pipelines.schema.shard_set_record``).
    """
    root = Path(shard_dir)
    # Every row, removed ones included: a row removed for one test set is still checked against a new one.
    shard_set = ShardSet(root, honour_removed=False)
    state_path = root / STATE
    state, rule_changed = _load_state(state_path, index)
    fingerprints = {name: index.fingerprint(name) for name in index.counts()}
    removed = set(schema.read_removed(root))
    new_matches: list[dict] = []
    per_set = {name: 0 for name in fingerprints}
    checked = pairs = rows = 0
    todo_all: set[str] = set()
    current = shard_set.manifest.get("signature_version") == sig.SIGNATURE_VERSION
    for i, shard in enumerate(shard_set.shards):
        entry = state["shards"].setdefault(shard["sha256"], {"path": shard["path"], "test_sets": {}})
        todo = {n for n, fp in fingerprints.items() if entry["test_sets"].get(n) != fp}
        if not todo:
            continue
        columns = [schema.KEY, schema.CONTENT_HASH, schema.PHASH]
        try:
            table = shard_set.open_shard(i)
            table = table.select(columns + [c for c in (schema.SOURCE, schema.IMAGE, schema.FORMAT, schema.HEIGHT,
                                                        schema.WIDTH) if c in table.column_names])
        except (KeyError, pa.ArrowInvalid) as exc:
            raise ShardSetError(f"{shard['path']}: missing {'/'.join(columns)} ({exc}); re-run the ingest") from None
        keys = table.column(schema.KEY).to_pylist()
        hashes = table.column(schema.CONTENT_HASH).to_pylist()
        phash = table.column(schema.PHASH).to_pylist()
        uris = table.column(schema.SOURCE).to_pylist() if schema.SOURCE in table.column_names else [""] * len(keys)
        coded, codes = _corpus_codes(table, phash, current)
        found: dict[int, dict] = {}

        def name_row(row: int, r: int, d: int, exact: bool, direction: str) -> dict:
            return {"key": keys[row], "source": uris[row], "test_set": index.test_set[r],
                    "matched_key": index.key[r], "test_uri": index.source[r], "distance": int(d),
                    "exact": exact, "direction": direction}

        if len(codes):
            qi, rec, dist, code = index.search_corpus(codes)
            for q, r, d, c in zip(qi.tolist(), rec.tolist(), dist.tolist(), code.tolist()):
                row = coded[q]
                if index.test_set[r] in todo and (row not in found or d < found[row]["distance"]):
                    found[row] = name_row(row, r, d, False, REVERSE if c else FORWARD)
        for row, h in enumerate(hashes):
            for r in index.exact(h):
                if index.test_set[r] in todo:
                    found[row] = name_row(row, r, 0, True, "exact")
                    break
        for row in sorted(found):
            m = found[row]
            if m["key"] not in removed:
                removed.add(m["key"])
                new_matches.append(m)
                per_set[m["test_set"]] = per_set.get(m["test_set"], 0) + 1
        checked += 1
        pairs += len(todo)
        rows += len(keys)
        todo_all.update(todo)
        for n in todo:
            entry["test_sets"][n] = fingerprints[n]
    schema.append_removed(root, [{**m, "mlflow_run_id": run_id} if run_id else m for m in new_matches])
    if pairs:
        if run_id:
            state.setdefault("runs", []).append({"mlflow_run_id": run_id, "new_removals": len(new_matches),
                                                 "test_sets": sorted(todo_all)})
        atomic_write(state_path, json.dumps(state, indent=1, sort_keys=True))
    return RescanResult(len(shard_set.shards), checked, pairs, rows, new_matches, per_set,
                        rule_changed if pairs else None)
