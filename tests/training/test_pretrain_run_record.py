"""training.pretrain's run record: a resumed pre-training reopens the MLflow run it was killed in,
and a run replaced with --overwrite does not stay RUNNING."""
from __future__ import annotations

import dataclasses
import json

from tests.conftest import mlflow_client
from training.pretrain import RUN_RECORD, PretrainConfig, _claim


def test_a_sigkilled_run_is_reopened_on_resume_and_marked_killed_when_replaced(tmp_path, mlflow_store):
    client = mlflow_client()
    # What a SIGKILLed driver leaves: its run RUNNING, its id in the output's run record.
    dead = client.create_run(client.create_experiment("vitscale-pretrain")).info.run_id
    out = tmp_path / "out"
    out.mkdir()
    cfg = PretrainConfig(data=str(tmp_path / "shards"), output=str(out), run_name="r1")
    (out / RUN_RECORD).write_text(json.dumps({"run_name": "r1", "config": dataclasses.asdict(cfg),
                                              "mlflow_run_id": dead}))
    storage = (str(out / "ray"), None)

    *_, reopen = _claim(dataclasses.replace(cfg, run_name=None), storage)
    assert reopen == dead
    assert json.loads((out / RUN_RECORD).read_text())["mlflow_run_id"] == dead

    replaced, *_, reopen = _claim(dataclasses.replace(cfg, run_name=None, overwrite=True), storage)
    assert reopen is None and replaced.run_name != "r1"
    assert client.get_run(dead).info.status == "KILLED"
