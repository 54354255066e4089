"""Where a small pre-training fit's time goes: Ray Train's fixed cost against the steps it trains.

Builds a tiny shard set (16 crops of two bundled photographs, prepared at 32 px), then in this one
process, for each mode, on a Ray started in-process for that mode before anything is timed:

- ``--fits`` runs, after one untimed, of :func:`training.pretrain.run_pretrain` (a depth-1 Ti/8 at 32 px, batch 4,
  ``--steps`` steps, one Ray Train worker, a fresh output each), timed whole: the run's checks and
  MLflow run, the fit, the model's copy and figures;
- the CPU seconds each fit cost the whole machine (every process busy, Ray's workers included,
  from ``/proc/stat``: run it on a quiet machine);
- the actors each fit started, by class, read from the Ray session's worker logs (the session's
  own, such as Ray's autoscaling coordinator, count once over all its fits).

The modes: ``project`` starts Ray as :func:`training.ray_utils.init_ray` does (Ray Train set for one
node, ``ONE_NODE_TRAIN``); ``ray-defaults`` starts it the same way with Ray Train's own defaults
(the preemption watcher on, a 2 s health check).

The anchor, measured in the same run: the same steps as a plain torch loop in this process (the same
model, batch and optimiser; no Ray, no data pipeline). ``fixed_s`` is a fit's median less the loop.
The last line printed is one JSON object.

    python benchmarks/fit_startup.py [--fits 3] [--steps 4] [--modes project,ray-defaults] [--keep DIR]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import machine  # noqa: E402

TINY = dict(variant="Ti/8", depth=1, img_size=32, batch_size=4, num_workers=1, warmup_steps=1, holdout=0,
            checkpoint_every=2)
RAY_DEFAULTS = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2.0"}


def build_shards(work: Path) -> Path:
    """The test suite's tiny shard set: 8 crops each of two photographs, two classes, 32 px."""
    from common.photos import crop_folder
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    crop_folder(work / "src")
    run_prepare(PrepareConfig(input=[str(work / "src")], output=str(work / "shards"), size=32, workers=1))
    return work / "shards"


def plain_loop_s(steps: int) -> float:
    """The fit's steps as a plain loop: the anchor."""
    import torch

    import vitcore

    torch.manual_seed(0)
    model = vitcore.create_model(TINY["variant"], num_classes=2, img_size=TINY["img_size"], depth=TINY["depth"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(TINY["batch_size"], 3, 32, 32), torch.randint(0, 2, (TINY["batch_size"],))
    start = time.perf_counter()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def actors_started(session: Path) -> collections.Counter:
    """The actors this Ray session started, by class (each one a worker process; Ray moves the logs
    of those that ended to ``logs/old``)."""
    found = collections.Counter()
    for log in [*(session / "logs").glob("worker-*.out"), *(session / "logs" / "old").glob("worker-*.out")]:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(":actor_name:"):
                found[line.removeprefix(":actor_name:")] += 1
    return found


def run_mode(mode: str, shards: Path, work: Path, fits: int, steps: int) -> dict:
    import ray

    from training.pretrain import PretrainConfig, run_pretrain
    from training.ray_utils import init_ray

    saved = {k: os.environ.get(k) for k in RAY_DEFAULTS}
    if mode == "ray-defaults":
        os.environ.update(RAY_DEFAULTS)
    try:
        init_ray(num_cpus=4, log_to_driver=False)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    times, cpu = [], []
    for i in range(fits + 1):  # the first warms this process and Ray's worker pool, untimed
        out = work / mode / f"fit{i}"
        start, busy = time.perf_counter(), machine.busy_cpu_s()
        run_pretrain(PretrainConfig(data=str(shards), output=str(out), steps=steps, **TINY))
        times.append(time.perf_counter() - start)
        cpu.append(machine.busy_cpu_s() - busy if busy is not None else None)
        print(f"fit_startup: {mode} fit {i}/{fits}: {times[-1]:.1f}s, {cpu[-1] or 0:.1f} CPU s", file=sys.stderr)
    times, cpu = times[1:], cpu[1:]
    ray.shutdown()
    actors = actors_started(session)
    fits += 1
    return {"fit_s": [round(t, 2) for t in times], "fit_median_s": round(statistics.median(times), 2),
            "fit_cpu_s": [round(c, 1) for c in cpu if c is not None],
            "fit_cpu_median_s": round(statistics.median(cpu), 1) if None not in cpu else None,
            "actors_per_fit": {k: round(v / fits, 2) for k, v in sorted(actors.items())},
            "processes_per_fit": round(sum(actors.values()) / fits, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fits", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--modes", default="project,ray-defaults")
    parser.add_argument("--keep", help="write into this folder and keep it")
    args = parser.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="fit_startup_"))
    os.environ["VITSCALE_HOME"] = str(work / "mlruns")
    try:
        shards = build_shards(work)
        plain = statistics.median(plain_loop_s(args.steps) for _ in range(3))
        modes = {m: run_mode(m, shards, work, args.fits, args.steps) for m in args.modes.split(",")}
        for m in modes.values():
            m["fixed_s"] = round(m["fit_median_s"] - plain, 2)
        report = {"benchmark": "fit_startup", "steps": args.steps, "fits": args.fits,
                  "plain_loop_s": round(plain, 3), "modes": modes, "machine": machine.describe()}
        if {"project", "ray-defaults"} <= modes.keys():
            report["fit_ratio_vs_ray_defaults"] = round(
                modes["project"]["fit_median_s"] / modes["ray-defaults"]["fit_median_s"], 3)
        print(json.dumps(report))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
