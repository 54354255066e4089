"""Every input accounted for: the manifest, built from the pipeline's outputs and reconciled.

Counts come from the pipeline's outputs (quarantine rows, duplicate rows, shard row counts)
against an independent count of the items read, never from Beam's counters, which may count
a retried bundle twice. :func:`summarise` refuses a manifest when
``inputs != written + rejected + duplicates``; the driver then runs the pipeline once more
(:data:`MAX_ATTEMPTS` runs in all).
"""
from __future__ import annotations

from typing import Mapping

from neardup.signatures import SIGNATURE_VERSION
from pipelines import schema

#: Runs of the whole pipeline before an accounting mismatch is an error.
MAX_ATTEMPTS = 2


class AccountingError(RuntimeError):
    """``inputs != written + rejected + duplicates``: an item was lost or counted twice."""


def where_lost(outputs: list[dict]) -> str:
    """Which side of the shuffle to the shard writers the accounting broke on, for the error message."""
    sent = sum(r["n"] for r in outputs if r["_t"] == "records")
    received = sum(r.get("received", 0) for r in outputs if r["_t"] == "shard")
    if sent == received:
        return f" before the shuffle ({sent} records reached it and all came out)"
    return (f": {sent} records went into the shuffle to the shard writers and {received} came out of it, "
            "so the runner lost or repeated data between those steps")


def _tables(outputs: list[dict]) -> tuple[list, list, list]:
    """(shard entries, quarantine rows, duplicate rows), each in a stable order."""
    shards = sorted(
        ({k: r[k] for k in ("path", "rows", "bytes", "sha256")} for r in outputs if r["_t"] == "shard"),
        key=lambda s: s["path"],
    )
    quarantine = sorted(
        ({k: r[k] for k in ("uri", "reason", "detail", "key")} for r in outputs if r["_t"] == "rejected"),
        key=lambda r: (r["uri"], r["reason"], r["detail"]),
    )
    duplicates = sorted(
        ({k: v for k, v in r.items() if k != "_t"} for r in outputs if r["_t"] == "duplicate"),
        key=lambda r: (r["key"], r["uri"], r["cause"]),
    )
    return shards, quarantine, duplicates


def _counts(inputs: int, shards: list, quarantine: list, duplicates: list, test_sets) -> dict:
    rejected: dict[str, int] = {}
    for r in quarantine:
        rejected[r["reason"]] = rejected.get(r["reason"], 0) + 1
    dup_counts = {"corpus": 0, **{name: 0 for name in test_sets}}
    for r in duplicates:
        dup_counts[r["cause"]] = dup_counts.get(r["cause"], 0) + 1
    return {
        "inputs": inputs, "written": sum(s["rows"] for s in shards),
        "rejected": dict(sorted(rejected.items())), "rejected_total": sum(rejected.values()),
        "duplicates": dup_counts, "duplicates_total": sum(dup_counts.values()),
    }


def summarise(outputs: list[dict], output: str, sources: list[str], label_map: Mapping[str, int] | None,
              test_sets) -> tuple[dict, list, list]:
    """(manifest, quarantine rows, duplicate rows) of one run's ``outputs``; AccountingError if they do not add up."""
    inputs = sum(r["n"] for r in outputs if r["_t"] == "inputs")
    shards, quarantine, duplicates = _tables(outputs)
    counts = _counts(inputs, shards, quarantine, duplicates, test_sets)
    written = counts["written"]
    if inputs != written + counts["rejected_total"] + counts["duplicates_total"]:
        raise AccountingError(
            f"{output}: inputs ({inputs}) != written ({written}) + rejected ({counts['rejected_total']}) "
            f"+ duplicates ({counts['duplicates_total']}); items were lost or double-counted"
            + where_lost(outputs)
        )
    maps = [r["map"] for r in outputs if r["_t"] == "label_map"]
    final_map = label_map if label_map is not None else (maps[0] if maps else {})
    manifest = {
        "schema_version": schema.SCHEMA_VERSION,
        "format": "arrow-ipc-file",
        "columns": list(schema.COLUMNS),
        "shards": shards,
        "num_rows": written,
        "label_map": dict(sorted(final_map.items(), key=lambda kv: kv[1])),
        "counts": counts,
        "sources": list(sources),
        # dedup.rescan recomputes the phash codes of a set written under another version.
        "signature_version": SIGNATURE_VERSION,
    }
    return manifest, quarantine, duplicates


def run_metrics(manifest: dict, wall: float, workers: int) -> dict[str, float]:
    """The MLflow metrics of a finished run: its counts, size, wall time and rates."""
    counts = manifest["counts"]
    metrics = {
        "inputs": counts["inputs"], "written": counts["written"],
        "rejected": counts["rejected_total"], "duplicates": counts["duplicates_total"],
        "shards": len(manifest["shards"]), "output_mb": sum(s["bytes"] for s in manifest["shards"]) / 1e6,
        "wall_s": wall, "attempts": manifest["attempts"],
        "images_per_s": counts["inputs"] / wall if wall > 0 else 0.0,
        "images_per_s_per_worker": counts["inputs"] / wall / max(workers, 1) if wall > 0 else 0.0,
    }
    metrics.update({f"rejected.{k}": v for k, v in counts["rejected"].items()})
    metrics.update({f"duplicates.{k}": v for k, v in counts["duplicates"].items()})
    return metrics


#: A run is warned about when one rejection reason takes more than this share of its inputs.
DOMINANT_SHARE = 0.5


def _top_reason(counts: dict) -> tuple[str, int]:
    """The most common reason an input was not written (a rejection reason or a duplicate cause)."""
    reasons = {**counts["rejected"], **{f"duplicate of {k}": v for k, v in counts["duplicates"].items() if v}}
    return max(sorted(reasons.items()), key=lambda kv: kv[1]) if reasons else ("none", 0)


def _example(quarantine: list, reason: str) -> str:
    detail = next((r["detail"] for r in quarantine if r["reason"] == reason), "")
    return f", e.g. {detail}" if detail else ""


def nothing_written(manifest: dict, quarantine: list) -> str | None:
    """The one-line error of a run that wrote no image, or None when it wrote some."""
    counts = manifest["counts"]
    if counts["written"]:
        return None
    reason, n = _top_reason(counts)
    return (f"{counts['inputs']} inputs -> 0 written ({counts['rejected_total']} quarantined {counts['rejected']}, "
            f"{counts['duplicates_total']} duplicates); most common reason: {reason} ({n}){_example(quarantine, reason)}")


def dominant_rejection(manifest: dict, quarantine: list) -> str | None:
    """A one-line warning when most inputs were rejected for one reason, else None."""
    counts = manifest["counts"]
    reason, n = _top_reason({**counts, "duplicates": {}})
    if not counts["inputs"] or n <= DOMINANT_SHARE * counts["inputs"]:
        return None
    return (f"{n} of {counts['inputs']} inputs were quarantined as {reason}{_example(quarantine, reason)}; "
            f"see quarantine.jsonl")
