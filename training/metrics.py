"""Rank 0's metrics sink for pre-training: the MLflow run the driver opened, and the driver's progress board.

Ray Train V2 rejects ``MLflowLoggerCallback``, so rank 0 logs into the run by id, from a background
queue through a spool beside the checkpoints (:mod:`common.tracking_queue`): a tracking outage
never stops training. Every rank
calls the sink, because the images, loss and accuracy it reports are summed over all workers.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from common import tracking
from common.tracking_queue import MetricsQueue
from training.loop import all_reduce_sum

# How long the end of training waits for the tracker; what it has not taken stays in the spool.
CLOSE_TIMEOUT_S = 120.0


#: MLflow names of the figures a checkpoint is reported with that the step lines also log, with
#: another meaning (rank 0's mean over ``log_every`` steps against all ranks' since the checkpoint).
WINDOW_KEYS = {"train_loss": "checkpoint_train_loss", "images_per_second": "checkpoint_images_per_second"}

class Window:
    """This rank's sums since the window opened, which a logged or reported mean divides out."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.images = self.wait = 0.0
        self.steps = 0
        # Device tensors once a step adds to them, read back only when they are logged.
        self.loss: Any = 0.0  # sum of the steps' mean losses
        self.loss_images: Any = 0.0  # sum of mean loss x images
        self.correct: Any = 0.0

    def add(self, images: int, loss: Any) -> None:
        self.images += images
        self.steps += 1
        self.loss = self.loss + loss
        self.loss_images = self.loss_images + loss * images


class MetricsSink:
    """Step metrics every ``log_every`` steps, report metrics with each checkpoint, and any other
    scores (few-shot, held-out) as they come; rank 0 writes them, the others only sum."""

    def __init__(self, *, rank: int, world: int, device: torch.device, run_id: str | None, uri: str | None,
                 board: Any, log_every: int, total_steps: int, end_step: int,
                 peak_flops: float | None, flops_per_image: float, spool: str | Path | None = None) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.run_id, self.uri, self.board = run_id, uri, board
        # Rank 0's queue to the run, opened at its first metric; without a spool folder, logged in line.
        self.spool, self.queue = spool, None
        self.log_every, self.total_steps, self.end_step = log_every, total_steps, end_step
        self.peak_flops, self.flops_per_image = peak_flops, flops_per_image
        self.since_log, self.since_report = Window(), Window()
        self._report_row: dict | None = None  # posted once its checkpoint is saved

    @property
    def logs_to_mlflow(self) -> bool:
        """Whether this rank writes to the MLflow run: rank 0, when the driver opened one."""
        return self.rank == 0 and bool(self.run_id)

    @property
    def posts_progress(self) -> bool:
        """Whether this rank posts progress rows to the driver's board: rank 0, when there is one."""
        return self.rank == 0 and self.board is not None

    def sync(self) -> None:
        # Timings read on the host must wait for the device's queued work.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self.sync()
        self.since_log.reset()
        self.since_report.reset()

    def record(self, images: int, loss: Any) -> None:
        self.since_log.add(images, loss)
        self.since_report.add(images, loss)

    def record_wait(self, seconds: float) -> None:
        self.since_log.wait += seconds

    def record_correct(self, correct: Any) -> None:
        self.since_report.correct = self.since_report.correct + correct

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.logs_to_mlflow and self.spool is None:
            tracking.log_metrics_to(self.run_id, metrics, step=step, uri=self.uri)
        elif self.logs_to_mlflow:
            if self.queue is None:
                self.queue = MetricsQueue(self.run_id, uri=self.uri or tracking.tracking_uri(),
                                          spool=Path(self.spool) / self.run_id)
            self.queue.log(metrics, step)

    def close(self) -> None:
        """Send what rank 0 has queued; what the server does not take stays in the spool for a resume."""
        if self.queue is not None:
            self.queue.close(timeout=CLOSE_TIMEOUT_S)

    def log_step(self, step: int, lr: float, grad_norm: Any) -> None:
        """At each log interval: the interval's loss, learning rate, throughput and input wait."""
        if step % self.log_every:
            return
        self.sync()
        w = self.since_log
        elapsed = time.perf_counter() - w.start
        images_all, wait_all = all_reduce_sum([w.images, w.wait], self.device)
        if self.logs_to_mlflow:
            metrics = {"train_loss": float(w.loss) / w.steps, "lr": lr, "grad_norm": float(grad_norm),
                       "images_per_second_per_worker": w.images / elapsed,
                       "images_per_second": images_all / elapsed,
                       "input_wait_fraction": wait_all / (self.world * elapsed)}
            if self.peak_flops:
                # MFU: model FLOPs (vitcore's count, backward = 2x forward) over the bf16 peak.
                metrics["mfu"] = w.images / elapsed * self.flops_per_image / self.peak_flops
            self.log(metrics, step)
        if self.posts_progress:
            self.board.post.remote({"kind": "step", "time": time.time(), "step": step, "total": self.total_steps,
                                    "end": self.end_step, "loss": float(w.loss) / w.steps,
                                    "images_per_second": images_all / elapsed})
        w.reset()

    def report(self, step: int, epoch: int, held: dict[str, float]) -> dict[str, float]:
        """The metrics a checkpoint is reported with: the train loss and accuracy since the last one."""
        w = self.since_report
        elapsed = time.perf_counter() - w.start
        seen_all, loss_all, correct_all = all_reduce_sum([w.images, float(w.loss_images), float(w.correct)],
                                                         self.device)
        metrics = {"epoch": epoch, "step": step, "train_loss": loss_all / max(1, seen_all),
                   "train_accuracy": correct_all / max(1, seen_all),
                   "images_per_second": seen_all / max(elapsed, 1e-9), **held}
        # The step lines' train_loss and images_per_second are rank 0's and the interval's; these
        # are every rank's since the last checkpoint, so they go to MLflow under names of their own.
        self.log({WINDOW_KEYS.get(k, k): v for k, v in metrics.items() if k != "step"}, step)
        self._report_row = {"kind": "report", "total": self.total_steps, **metrics}
        return metrics

    def saved(self) -> None:
        """The checkpoint of the last report is saved: only now does the console say so (a save
        cut short by a full disk raises before this)."""
        if self.posts_progress and self._report_row:
            self.board.post.remote(self._report_row)
        self._report_row = None
        # The next report's window opens after the save, so that its throughput leaves the save out.
        self.since_report.reset()
