"""The end-to-end demo (`make demo`): generated corpus → Beam → Ray Train → Ray Tune → MLflow.

    python jobs/demo.py [--workdir demo_output] [--epochs 12] ...
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import parse_args  # noqa: E402
from demo.run import DemoConfig, format_table, run_demo  # noqa: E402


def main(argv=None) -> int:
    cfg = parse_args(DemoConfig, argv, prog="demo")
    summary = run_demo(cfg)
    print()
    print(format_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
