"""Write a VTAB-1k task folder (train800/, val200/, test/ shard sets). Run with --help for every option.

    python jobs/vtab_prepare.py --source tfds --task dtd --tfds-data-dir ~/tensorflow_datasets --output /data/vtab/dtd
    python jobs/vtab_prepare.py --source folders --input raw/mytask --output /data/mytask
    python jobs/vtab_prepare.py --source split --input shards/mytask-train --output /data/mytask
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import run_job  # noqa: E402
from transfer.vtab_data import VtabPrepareConfig, run_vtab_prepare  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return run_job(VtabPrepareConfig, run_vtab_prepare, argv, prog="vtab_prepare")


if __name__ == "__main__":
    sys.exit(main())
