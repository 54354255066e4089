"""A scaling study: pre-train every model on nested fractions of a shard set, then compare their
best few-shot accuracy against images and compute (the paper's Figures 4 and 5).

    python jobs/study.py --data shards/ --task digits=vtab/digits --config configs/pretrain-demo-tiny.yaml \
        --models Ti/16,BiT-R50x1 --fractions 0.1,0.3,1 --shots 5,10 --budget epochs --epochs 10
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import run_job  # noqa: E402
from reports.study import run_and_draw  # noqa: E402
from training.study import StudyConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    # The study, then Figures 4 and 5 beside study_table.json and on the study's parent run.
    return run_job(StudyConfig, run_and_draw, argv, prog="study")


if __name__ == "__main__":
    sys.exit(main())
