"""The scheduled de-duplication pass: refresh the test-set index, re-check shards, report, log.

``jobs/dedup.py`` is its entrypoint. Incremental at both ends: the index only
decodes test images it has not seen (``pipelines.testsets.add_source``), and
:func:`dedup.rescan.rescan` only matches new shards or new/changed test sets.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from PIL import Image

from common import tracking
from common.config import check
from common.jobenv import durable_path
from common.locks import DataLock, FolderLock
from dedup.rescan import rescan
from neardup.index import IndexOutdated, TestSetIndex
from neardup.report import pick_for_audit, write_report
from pipelines.config import parse_test_sets
from pipelines.schema import MANIFEST, ShardSet, decode_row_image, shard_set_record
from pipelines.testsets import build_test_set_index, check_sources, iter_images


@dataclasses.dataclass
class DedupConfig:
    """Re-check an existing shard set against downstream test sets and write removed.jsonl."""

    shards: str = dataclasses.field(metadata={"help": f"shard set directory (the ingest output, with {MANIFEST})"})
    test_set: list[str] = dataclasses.field(default_factory=list, metadata={
        "help": "test set as name=source (any source the ingest accepts, or a shard set); repeatable"})
    index_dir: str | None = dataclasses.field(default=None, metadata={"recipe": False, 
        "help": "where the test-set index lives; default SHARDS/dedup_index"})
    report_dir: str | None = dataclasses.field(default=None, metadata={"recipe": False, 
        "help": "where counts, matches and the contact sheet go; default SHARDS/dedup_report"})
    threshold: int | None = dataclasses.field(default=None, metadata={
        "help": "Hamming threshold in bits; default the calibrated neardup.index.DEFAULT_THRESHOLD"})
    parent_run_id: str | None = dataclasses.field(default=None, metadata={"recipe": False, "help": "MLflow run to nest under"})

    def __post_init__(self):
        check(bool(self.shards), "shards", "required: the shard set directory to re-check")
        check(bool(self.test_set) or self.index_dir is not None, "test_set",
              "give at least one --test-set name=source, or an --index-dir that already holds test sets")
        parse_test_sets(self.test_set)


def _load_or_discard(index_dir: Path, threshold: int | None) -> TestSetIndex | None:
    """The saved index, or None (after deleting it) when another rule built it: it is rebuilt from the sources."""
    if not (index_dir / "index.json").exists():
        return None
    try:
        return TestSetIndex.load(index_dir, threshold=threshold)
    except IndexOutdated as exc:
        # The library's advice (delete it and rebuild) is what this job does itself: say only why.
        reason = str(exc).split("; delete ", 1)[0]
        print(f"dedup: the test-set index is outdated ({reason}); rebuilding it from the test-set sources",
              file=sys.stderr)
        for f in list(index_dir.glob("*.arrow")) + [index_dir / "index.json"]:
            f.unlink()
        return None


def _corpus_loader(shard_dir: Path, keys: set[str]):
    shard_set = ShardSet(shard_dir, honour_removed=False)
    rows: dict[str, dict] = {}

    def load(key: str) -> Image.Image | None:
        if not rows:  # one pass over the shards, keeping only the audited rows
            for batch in shard_set.iter_batches():
                for row in batch.to_pylist():
                    if row["key"] in keys:
                        rows.setdefault(row["key"], row)
        row = rows.get(key)
        return None if row is None else Image.fromarray(decode_row_image(row))
    return load


def _test_loader(sources: dict[str, str], wanted: set[tuple[str, str]]):
    # Only the audited images are kept: holding every decoded test image took gigabytes for a 10k test set.
    cache: dict[str, dict[str, Image.Image]] = {}

    def load(test_set: str, key: str) -> Image.Image | None:
        if test_set not in sources:
            return None
        if test_set not in cache:
            cache[test_set] = {it.key: it.image for it in iter_images(sources[test_set])
                               if it.image is not None and (test_set, it.key) in wanted}
        return cache[test_set].get(key)
    return load


def run(cfg: DedupConfig) -> dict:
    """Refresh the index, rescan the shards, write the report; returns a summary dict (also logged to MLflow)."""
    # The shards get removed.jsonl, and the index and report are kept: none may vanish with Ray's upload.
    cfg = dataclasses.replace(cfg, **{name: durable_path(getattr(cfg, name), name)
                                      for name in ("shards", "index_dir", "report_dir") if getattr(cfg, name)})
    tracking.tracking_uri()
    shard_dir = Path(cfg.shards)
    num_rows = ShardSet(shard_dir, honour_removed=False).manifest.get("num_rows")  # refuses a non-shard set first
    index_dir = Path(cfg.index_dir) if cfg.index_dir else shard_dir / "dedup_index"
    report_dir = Path(cfg.report_dir) if cfg.report_dir else shard_dir / "dedup_report"
    sources = parse_test_sets(cfg.test_set)
    check_sources(sources)
    params = dataclasses.asdict(cfg)
    record = shard_set_record(shard_dir, role="checked")
    name = f"dedup {record['name']} vs {', '.join(sources) or 'saved test sets'}"
    # removed.jsonl, the index and the report go into the shard set: one writer at a time, dedup or prepare.
    # A run that reads the set would train on rows removed under it: refused while one does.
    with FolderLock(str(shard_dir), "prepare", writer="dedup"), \
            DataLock(shard_dir, "dedup", exclusive=True, field_name="shards"):
        with tracking.start_run("dedup", params=params, parent_run_id=cfg.parent_run_id, run_name=name,
                                tags=tracking.run_tags(cfg, data=[record])) as run_:
            tracking.log_shard_inputs([record])
            base = _load_or_discard(index_dir, cfg.threshold)
            index = build_test_set_index(sources, threshold=cfg.threshold, base=base)
            index.save(index_dir)
            result = rescan(shard_dir, index, run_id=run_.info.run_id)
            # What the data has now, this run's removals included.
            tracking.set_tags({tracking.TAG_DEDUP_STATE: shard_set_record(shard_dir)["dedup_state"]})
            summary = {
                "message": result.summary(), "nothing_new": result.nothing_new,
                "shards_total": result.shards_total, "shards_checked": result.shards_checked,
                "pairs_checked": result.pairs_checked, "rows_scanned": result.rows_scanned,
                "new_removals": len(result.new_matches), "removals_per_test_set": result.matches_per_test_set,
                "rule_changed": result.rule_changed,
                "test_images": index.counts(), "test_quarantined": len(index.quarantine),
                "threshold": index.threshold, "mlflow_run_id": run_.info.run_id,
            }
            tracking.log_metrics({"new_removals": len(result.new_matches), "shards_checked": result.shards_checked,
                                  "rows_scanned": result.rows_scanned, "test_quarantined": len(index.quarantine),
                                  **{f"removed.{k}": v for k, v in result.matches_per_test_set.items()}})
            tracking.log_dict(summary, "dedup_summary.json")
            if index.quarantine:
                tracking.log_dict([dataclasses.asdict(q) for q in index.quarantine], "test_set_quarantine.json")
            if not result.nothing_new:
                # The loaders keep the pixels of the audited pairs only, not of every match (memory grew with them).
                audited = [m for group in pick_for_audit(result.new_matches) for m in group]
                paths = write_report(report_dir, result.new_matches, test_images=index.counts(),
                                     corpus_images=int(num_rows if num_rows is not None else result.rows_scanned),
                                     threshold=index.threshold, load_corpus=_corpus_loader(shard_dir, {m["key"] for m in audited}),
                                     load_test=_test_loader(sources, {(m["test_set"], m["matched_key"]) for m in audited}))
                for p in paths.values():
                    tracking.log_artifact(p, "dedup_report")
                summary["report_dir"] = str(report_dir)
    return summary
