"""Pre-training's few-shot scoring on downstream task folders: fit on train800 and val200, scored on
test, each task's scores apart; bad task flags refused in one line."""
import shutil

import pytest

import vitcore
from common.config import ConfigError
from training.pretrain import PretrainConfig
from training.task_folders import SPLITS
from training.trainer import _fewshot_scores, _fewshot_sets


def test_a_task_is_fit_on_train_and_val_and_scored_on_test_under_its_own_name(tiny_shards, tmp_path):
    for split in SPLITS:
        shutil.copytree(tiny_shards, tmp_path / "tiny" / split)
    cfg = PretrainConfig(data=str(tiny_shards), fewshot_data=str(tiny_shards), fewshot_every=1, variant="mu/8",
                         fewshot_task=[f"natural/tiny={tmp_path / 'tiny'}"], fewshot_shots=[1, 5], img_size=32,
                         batch_size=4, num_workers=1)
    halves, task = _fewshot_sets(cfg)
    assert (len(halves["fit"]), len(halves["test"])) == (8, 8)  # --fewshot-data: one set of 16, halved
    assert (len(task["fit"]), len(task["test"])) == (32, 16)  # train800 + val200, then test
    model = vitcore.create_model("mu/8", num_classes=2, img_size=32).eval()
    assert set(_fewshot_scores(model, task, 8, cfg.fewshot_shots)) == {"fewshot_tiny_1shot_accuracy",
                                                                       "fewshot_tiny_5shot_accuracy"}
    assert set(_fewshot_scores(model, halves, 8, [1, 25])) == {"fewshot_1shot_accuracy"}  # 25 shots: too few rows


@pytest.mark.parametrize("options, message", [
    ({"fewshot_every": 5}, "fewshot_every: --fewshot-every and --fewshot-data or --fewshot-task go together"),
    ({"fewshot_task": ["t=d"]}, "fewshot_every: --fewshot-every and --fewshot-data or --fewshot-task go together"),
    ({"fewshot_every": 5, "fewshot_task": ["t=d", "natural/t=e"]}, "fewshot_task: 'natural/t': 't' is already"),
    ({"fewshot_every": 5, "fewshot_task": ["t=d"], "fewshot_shots": [0]}, "fewshot_shots: must be positive"),
])
def test_bad_fewshot_task_options_are_refused_in_one_line(options, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        PretrainConfig(data="d", **options)
