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


def test_the_console_hears_of_a_checkpoint_only_once_it_is_saved(ray_session):
    # A save cut short by a full disk was reported "checkpoint saved": the row was posted before the save.
    import ray
    import torch

    from training.metrics import MetricsSink
    from training.ray_utils import ProgressBoard

    board = ray.remote(num_cpus=0)(ProgressBoard).remote()
    sink = MetricsSink(rank=0, world=1, device=torch.device("cpu"), run_id=None, uri=None, board=board,
                       log_every=100, total_steps=4, end_step=4, peak_flops=None, flops_per_image=1.0)
    sink.report(step=2, epoch=0, held={})
    assert [r for r in ray.get(board.take.remote()) if r["kind"] == "report"] == []  # the save may still fail
    sink.saved()
    assert [r["step"] for r in ray.get(board.take.remote()) if r["kind"] == "report"] == [2]
    ray.kill(board)
