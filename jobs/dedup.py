"""Re-check shard sets against downstream test sets (paper Section 4.1) and write removed.jsonl.

    python jobs/dedup.py --shards /data/shards/jft --test-set cifar10=/data/cifar10/test --test-set pets=...

Incremental and idempotent: see dedup/job.py. Scheduling examples: infra/dedup/.
"""
from __future__ import annotations

import json
import os
import sys

# Run as a script, this file's folder comes first on sys.path and its name would
# shadow the ``dedup`` package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.cli import run_job
from dedup.job import DedupConfig, run


def _report(summary: dict) -> None:
    print(summary["message"])
    print(json.dumps(summary, sort_keys=True))


def main(argv: list[str] | None = None) -> int:
    return run_job(DedupConfig, run, argv, prog="dedup", report=_report)


if __name__ == "__main__":
    sys.exit(main())
