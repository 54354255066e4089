"""Ingest an image corpus into Arrow IPC shards: ``python jobs/prepare.py --input SRC --output DIR``.

Exits 0 when the run completed (quarantined items included), 2 on a usage or
config error, 1 when the counts do not reconcile.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.config import parse_args  # noqa: E402
from common.text import utf8_text  # noqa: E402

from pipelines.config import PrepareConfig  # noqa: E402
from pipelines.ingest import AccountingError, PrepareError, run_prepare  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(PrepareConfig, argv, prog="prepare")
    try:
        manifest = run_prepare(cfg)
    except PrepareError as exc:
        print(f"prepare: error: {exc}", file=sys.stderr)
        return 2
    except AccountingError as exc:
        print(f"prepare: {exc}", file=sys.stderr)
        return 1
    c = manifest["counts"]
    print(utf8_text(  # an output folder's name need not be UTF-8; stdout may be strict
        f"prepare: {c['inputs']} inputs -> {c['written']} written in {len(manifest['shards'])} shard(s), "
        f"{c['rejected_total']} quarantined {c['rejected']}, {c['duplicates_total']} duplicates {c['duplicates']}; "
        f"{cfg.output}/manifest.json (MLflow run {manifest['mlflow_run_id']})"
        + (f"; the counts reconciled on attempt {manifest['attempts']}" if manifest.get("attempts", 1) > 1 else "")
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
