"""Ingest an image corpus into Arrow IPC shards: ``python jobs/prepare.py --input SRC --output DIR``.

Exits 0 when the run completed (quarantined items included), 2 on a usage or
config error or when no image was written, 1 when the counts do not reconcile.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.cli import run_job  # noqa: E402
from common.text import utf8_text  # noqa: E402
from pipelines.config import PrepareConfig  # noqa: E402
from pipelines.ingest import AccountingError, run_prepare  # noqa: E402
from pipelines.schema import MANIFEST  # noqa: E402


def _report(manifest: dict) -> None:
    c = manifest["counts"]
    print(utf8_text(  # an output folder's name need not be UTF-8; stdout may be strict
        f"prepare: {c['inputs']} inputs -> {c['written']} written in {len(manifest['shards'])} shard(s), "
        f"{c['rejected_total']} quarantined {c['rejected']}, {c['duplicates_total']} duplicates {c['duplicates']}; "
        f"{manifest['config']['output']}/{MANIFEST} (MLflow run {manifest['mlflow_run_id']})"
        + (f"; the counts reconciled on attempt {manifest['attempts']}" if manifest.get("attempts", 1) > 1 else "")
    ))


def main(argv: list[str] | None = None) -> int:
    return run_job(PrepareConfig, run_prepare, argv, prog="prepare", report=_report, failures=(AccountingError,))


if __name__ == "__main__":
    sys.exit(main())
