"""Where a small Tune trial's time goes: start-up, training and finish, with and without reused actors.

Runs the demo's VTAB selection sweep (three generated tasks at 32 px, a 4-block Ti/8, 2 learning
rates x 2 schedules: 12 trials of ``transfer.vtab.vtab_trial``) twice in one Ray session: with
``reuse_actors`` (the project's setting, ``transfer.sweep.tune_sweep``) and without (the
baseline: a new Ray worker per trial). Per trial, on the machine's wall clock:

* ``startup_s``: a trial slot frees (the sweep starts, or an earlier trial returns) until the
  trial's first SGD step starts. Split into ``actor_s`` (until the trial function is entered:
  stopping the old actor, a placement group, a new worker process, unpickling the trainable) and
  ``setup_s`` (imports, the trial's MLflow run, the model and its datasets). Slots are paired
  with trials first come, first served, so with several trials at once a trial may be paired
  with another's slot; the sums are exact.
* ``train_s``: the first SGD step's start to the last one's end.
* ``finish_s``: the last step's end until the trial function returns (evaluation, the report to
  Tune, the MLflow run's end).

Per sweep: ``sweep_s`` (``Tuner.fit``), ``tail_s`` (the last trial's return to the end of the
fit), ``processes`` (distinct trial processes) and ``driver_cpu_s`` (CPU time of this process,
Tune's control loop, during the fit). ``same_metrics`` says whether both ways gave every trial the
same metrics. The final line is JSON.

    python benchmarks/tune_trial.py [--steps 40,80] [--batch-size 64] [--cpus N] [--repeat 1] [--data DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import machine  # noqa: E402

TASK_GROUPS = {"digits": "natural", "textures": "specialized", "count": "structured"}


def timed_trial(config: dict) -> None:
    """``transfer.vtab.vtab_trial``, recording when it was entered, its first and last SGD step and
    its return into ``config["bench_dir"]``. ``train_sgd`` imports ``accumulate_step`` from
    ``training.loop`` at each call, so replacing it there times the trial's steps unchanged."""
    from ray import tune

    from training import loop
    from transfer.vtab import vtab_trial

    entered = time.time()
    step = getattr(loop.accumulate_step, "__wrapped__", loop.accumulate_step)
    steps: list[tuple[float, float]] = []

    def timed_step(*args, **kwargs):
        start = time.time()
        out = step(*args, **kwargs)
        steps.append((start, time.time()))
        return out

    timed_step.__wrapped__ = step
    loop.accumulate_step = timed_step
    try:
        vtab_trial(config)
    finally:
        loop.accumulate_step = step
    row = {"pid": os.getpid(), "entered": entered, "first_step": steps[0][0], "last_step": steps[-1][1],
           "returned": time.time()}
    trial_id = tune.get_context().get_trial_id()
    (Path(config["bench_dir"]) / f"{trial_id}.json").write_text(json.dumps(row))


def make_tasks(root: Path, *, train: int, val: int, test: int) -> list[str]:
    """The demo's three generated tasks through the folders converter; their --task specs."""
    from demo.data import build_vtab_tasks
    from transfer.vtab_data import VtabPrepareConfig, run_vtab_prepare

    raw = build_vtab_tasks(root / "raw", train=train + val, test=test, size=32)
    specs = []
    for name, src in raw.items():
        run_vtab_prepare(VtabPrepareConfig(source="folders", input=str(src), output=str(root / name), size=32,
                                           train_size=train, val_size=val))
        specs.append(f"{TASK_GROUPS[name]}/{name}={root / name}")
    return specs


def make_pretrained(path: Path) -> Path:
    """The demo's pre-trained shape (Ti/8, 4 blocks, 32 px), randomly initialised."""
    import torch

    import vitcore

    torch.manual_seed(0)
    vitcore.save_checkpoint(vitcore.create_model("Ti/8", num_classes=24, img_size=32, depth=4), path)
    return path


def run_sweep(cfg, tasks: dict, work: Path, *, reuse: bool, label: str, slots: int) -> tuple[dict, dict]:
    """One selection sweep; its per-trial timings summarised, and each trial's metrics."""
    import dataclasses

    import psutil
    from ray import tune

    from common import tracking
    from transfer.sweep import trial_resources, tune_sweep

    bench = work / f"times-{label}"
    bench.mkdir()
    with tracking.start_run("vtab", run_name=f"tune_trial {label}") as run:
        space = {"task": tune.grid_search(list(tasks)), "setting": tune.grid_search(cfg.settings()), "phase": "select",
                 "cfg": dataclasses.asdict(cfg), "tasks": tasks, "mlflow_parent": run.info.run_id,
                 "mlflow_uri": tracking.tracking_uri(), "bench_dir": str(bench)}
        cpu0, start = psutil.Process().cpu_times(), time.time()
        grid = tune_sweep(timed_trial, space, name=label, output=work, prog="tune_trial",
                          resources=trial_resources(cfg.cpus_per_trial, 0), metric="val_accuracy",
                          label=("task", "setting.lr", "setting.steps"), reuse_actors=reuse)
        end, cpu1 = time.time(), psutil.Process().cpu_times()
    if grid.errors:
        raise RuntimeError(f"{label}: {len(grid.errors)} trials failed: {grid.errors[0]}")
    metrics = {(r.config["task"], r.config["setting"]["lr"], r.config["setting"]["steps"]):
               {k: r.metrics[k] for k in ("val_accuracy", "val_loss", "train_loss")} for r in grid}
    rows = sorted((json.loads(p.read_text()) for p in bench.glob("*.json")), key=lambda r: r["entered"])
    free = sorted([start] * slots + [r["returned"] for r in rows])
    for row, freed in zip(rows, free):
        row.update(actor_s=row["entered"] - freed, setup_s=row["first_step"] - row["entered"],
                   startup_s=row["first_step"] - freed, train_s=row["last_step"] - row["first_step"],
                   finish_s=row["returned"] - row["last_step"])
    summary = {"reuse_actors": reuse, "sweep_s": round(end - start, 2), "trials": len(rows),
               "processes": len({r["pid"] for r in rows}), "tail_s": round(end - max(r["returned"] for r in rows), 2),
               "driver_cpu_s": round(cpu1.user + cpu1.system - cpu0.user - cpu0.system, 2)}
    for key in ("startup_s", "actor_s", "setup_s", "train_s", "finish_s"):
        values = [r[key] for r in rows]
        summary[key] = {"median": round(statistics.median(values), 2), "sum": round(sum(values), 2)}
    busy = sum(r["returned"] - r["first_step"] for r in rows) + summary["startup_s"]["sum"]
    summary["startup_share"] = round(summary["startup_s"]["sum"] / busy, 3)
    return summary, metrics


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", default="40,80", help="schedules swept (the demo: 40,80)")
    p.add_argument("--lrs", default="0.03,0.1", help="learning rates swept (the demo: 0.03,0.1)")
    p.add_argument("--batch-size", type=int, default=64, help="SGD batch (the demo: 64)")
    p.add_argument("--train", type=int, default=160, help="train images per task (the demo: 160)")
    p.add_argument("--val", type=int, default=40, help="val images per task (the demo: 40)")
    p.add_argument("--cpus", type=int, default=None, help="Ray's logical CPUs (default: the machine's)")
    p.add_argument("--repeat", type=int, default=1, help="sweeps each way, alternated, project's first")
    p.add_argument("--data", default=None, help="folder for the tasks and the model, kept and reused (default: a new "
                                                 "temporary one)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tune_trial-"))
    os.environ["VITSCALE_HOME"] = str(work / "mlruns")
    os.environ.pop("MLFLOW_TRACKING_URI", None)

    from training.ray_utils import cpus_available, init_ray
    from transfer.vtab import VtabConfig
    from transfer.vtab_data import resolve_tasks

    load_before = os.getloadavg()[0]
    data = Path(args.data).resolve() if args.data else work
    if (data / "tasks.json").is_file():
        specs = json.loads((data / "tasks.json").read_text())
    else:
        specs = make_tasks(data / "tasks", train=args.train, val=args.val, test=20)
        make_pretrained(data / "model.safetensors")
        (data / "tasks.json").write_text(json.dumps(specs))
    cfg = VtabConfig(task=specs, no_crop=["count"], no_flip=["digits"], pretrained=str(data / "model.safetensors"),
                     output=str(work), img_size=32, lrs=[float(x) for x in args.lrs.split(",")],
                     steps=[int(x) for x in args.steps.split(",")], batch_size=args.batch_size, warmup_steps=5,
                     crop_min_area=0.6)
    tasks = resolve_tasks(None, cfg.task, no_flip=cfg.no_flip, no_crop=cfg.no_crop)
    init_ray(num_cpus=args.cpus, log_to_driver=False)
    slots = max(1, cpus_available() // cfg.cpus_per_trial)
    runs: dict[bool, list] = {True: [], False: []}
    for i in range(args.repeat):
        for reuse in (True, False):
            label = f"{'reuse' if reuse else 'fresh'}-{i}"
            summary, metrics = run_sweep(cfg, tasks, work, reuse=reuse, label=label, slots=slots)
            print(f"{label}: {json.dumps(summary)}", file=sys.stderr, flush=True)
            runs[reuse].append((summary, metrics))
    ours, base = runs[True][0][0], runs[False][0][0]
    walls = {k: statistics.median(s["sweep_s"] for s, _ in v) for k, v in runs.items()}
    first = runs[True][0][1]
    report = {
        "benchmark": "tune_trial", "machine": machine.describe(), "load_avg_1m_before": load_before,
        "sweep": {"trials": ours["trials"], "slots": slots, "steps": cfg.steps, "lrs": cfg.lrs,
                  "batch_size": cfg.batch_size, "model": "Ti/8 depth 4, 32 px", "repeat": args.repeat},
        "ours": ours, "baseline": base,
        "sweep_s_median": {"ours": walls[True], "baseline": walls[False]},
        "sweep_speedup": round(walls[False] / walls[True], 3),
        "startup_sum_ratio": round(ours["startup_s"]["sum"] / base["startup_s"]["sum"], 3),
        "same_metrics": all(m == first for v in runs.values() for _, m in v),
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
