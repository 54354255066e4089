"""The end-to-end demo (`make demo`): generated corpus → Beam → Ray Train → Ray Tune → MLflow.

    python jobs/demo.py [--workdir demo_output] [--epochs 12] ...
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import run_job  # noqa: E402
from demo.run import DemoConfig, format_table, run_demo  # noqa: E402


def _report(summary: dict) -> None:
    print()
    print(format_table(summary))


def main(argv=None) -> int:
    return run_job(DemoConfig, run_demo, argv, prog="demo", report=_report)


if __name__ == "__main__":
    sys.exit(main())
