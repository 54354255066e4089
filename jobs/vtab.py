"""VTAB-1k on Ray Tune: 2 learning rates x 2 schedules on train800, the best mean val200 setting retrained on
train800val200 and tested. Run with --help for every option.

    python jobs/vtab.py --data-root /data/vtab --pretrained pretrain_output/model.safetensors --output vtab_out
    python jobs/vtab.py --task dtd=/data/vtab/dtd --task natural/mytask=/data/mytask --output vtab_out
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import run_job  # noqa: E402
from transfer.vtab import CHART_FILE, RESULTS_FILE, VtabConfig, format_table, run_vtab  # noqa: E402


def vtab(cfg: VtabConfig) -> None:
    r = run_vtab(cfg)
    print(format_table(r))
    print(f"results: {r['output']}/{RESULTS_FILE}, chart: {r['output']}/{CHART_FILE}, MLflow run {r['mlflow_run_id']}")


def main(argv: list[str] | None = None) -> int:
    return run_job(VtabConfig, vtab, argv, prog="vtab")


if __name__ == "__main__":
    sys.exit(main())
