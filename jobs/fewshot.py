"""Few-shot linear evaluation (Section 4.1) over VTAB-style task folders. Run with --help for every option.

    python jobs/fewshot.py --pretrained pretrain_output/model.safetensors --task dtd=/data/vtab/dtd --output fewshot_out
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import run_job  # noqa: E402
from transfer.fewshot import RESULTS_FILE, FewshotConfig, format_table, run_fewshot  # noqa: E402


def fewshot(cfg: FewshotConfig) -> None:
    r = run_fewshot(cfg)
    print(format_table(r))
    print(f"results: {r['output']}/{RESULTS_FILE}, MLflow run {r['mlflow_run_id']}")


def main(argv: list[str] | None = None) -> int:
    return run_job(FewshotConfig, fewshot, argv, prog="fewshot")


if __name__ == "__main__":
    sys.exit(main())
