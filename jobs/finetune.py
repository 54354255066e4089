"""Fine-tune a pre-trained ViT over a learning-rate grid with Ray Tune. Run with --help for every option.

    python jobs/finetune.py --pretrained pretrain_output/model --train task/train --test task/test --lrs 0.003,0.01,0.03
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import run_job  # noqa: E402
from transfer.finetune import FinetuneConfig, run_finetune  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return run_job(FinetuneConfig, run_finetune, argv, prog="finetune")


if __name__ == "__main__":
    sys.exit(main())
