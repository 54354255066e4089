"""training.metrics: rank 0's metrics reach the run through the queue and its spool beside the checkpoints."""
from __future__ import annotations

import mlflow
import torch

from common import tracking
from training.metrics import MetricsSink


def test_rank_0_logs_through_the_spool_and_close_sends_everything(tmp_path, mlflow_store):
    uri = tracking.tracking_uri()
    with tracking.start_run("pretrain") as run:
        run_id = run.info.run_id
        sink = MetricsSink(rank=0, world=1, device=torch.device("cpu"), run_id=run_id, uri=uri, board=None,
                           log_every=1, total_steps=20, end_step=20, peak_flops=None, flops_per_image=1.0,
                           spool=tmp_path / "tracking_spool")
        for step in range(20):
            sink.log({"train_loss": 1.0 / (step + 1)}, step)
        sink.close()
    steps = [m.step for m in mlflow.MlflowClient(uri).get_metric_history(run_id, "train_loss")]
    assert sorted(steps) == list(range(20)) and len(steps) == 20
    assert (tmp_path / "tracking_spool" / run_id / "sent.json").is_file()
