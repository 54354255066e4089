"""Pre-train a ViT on Arrow shards with Ray Train. Run with --help for every option.

    python jobs/pretrain.py --data shards/ --variant Ti/16 --img-size 224 --num-workers 2
    ray job submit --working-dir . --runtime-env-json '{"env_vars": {"VITSCALE_HOME": "/abs/home"}}' \
        -- python jobs/pretrain.py --config configs/pretrain-b16-i21k.yaml --data /abs/shards --output runs/b16
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import run_job  # noqa: E402
from training.pretrain import PretrainConfig, run_pretrain  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return run_job(PretrainConfig, run_pretrain, argv, prog="pretrain")


if __name__ == "__main__":
    sys.exit(main())
