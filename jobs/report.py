"""Compare runs of the MLflow store in one self-contained HTML report (also logged as a `report` run).

    python jobs/report.py --output report.html [--experiment NAME ...] [--run-id ID ...]

The store is the stages' own: MLFLOW_TRACKING_URI, else $VITSCALE_HOME/mlflow.db, else ./mlruns/mlflow.db.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import run_job  # noqa: E402
from reports.report import ReportConfig, run_report  # noqa: E402


def report(cfg: ReportConfig) -> None:
    r = run_report(cfg)
    for ranking in r["rankings"]:
        print(f"{ranking['group']}: {ranking['verdict']}")
    print(f"report: {r['output']} ({r['runs']} runs), logged to MLflow run {r['mlflow_run_id']}")


if __name__ == "__main__":
    sys.exit(run_job(ReportConfig, report, prog="report"))
