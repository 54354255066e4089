"""VTAB-1k with Ray Tune: the ViT paper's protocol (Appendix B.1.1, Table 2, Figure 2).

"We use the same hyperparameter setting for all tasks [...] chosen by running a small sweep over
two learning rates and two schedules, and selecting the setting with the highest VTAB score on
the 200-example validation sets", at 384 px for every task. So:

1. ``select``: one Tune trial per task × (lr, steps), fine-tuned on train800, scored on val200;
2. the setting with the highest *mean* val200 accuracy over the tasks is chosen (test is not read);
3. ``final``: each task fine-tuned again on train800val200 with that setting, scored on test.

Every trial starts from the pre-trained model with its position embeddings interpolated to
``img_size`` and one zero-initialised linear head, and trains with the fine-tuning recipe of
:mod:`transfer.sgd` (SGD momentum 0.9, batch 512 via accumulation, clip 1, warm-up + cosine), with
each task's flip/crop exclusions. Trials run concurrently as Ray's resources allow, are retried
on failure, and a re-run with the same ``--output`` resumes both sweeps (:mod:`transfer.sweep`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import field
from pathlib import Path
from typing import Any

from common import plots, tracking
from common.config import check, not_recipe, parse_named
from common.fs import atomic_write, make_output_dir
from common.jobenv import durable_path
from common.locks import FolderLock, check_owner, claim_folder, reading
from training.ray_utils import init_ray
from transfer.sgd import TrainSpec, check_batching, load_backbone, pretrained_file, start_trial, train_sgd
from transfer.sweep import manifest_digests, open_sweep_state, report_final, sweep_run, trial_resources, tune_sweep
from transfer.vtab_data import resolve_tasks, split_dirs, task_records
from transfer.vtab_tasks import GROUPS

RESULTS_FILE = "vtab_results.json"
CHART_FILE = "vtab_results.png"


@dataclasses.dataclass
class VtabConfig:
    """VTAB-1k: sweep 2 learning rates x 2 schedules on train800 with Ray Tune, pick by mean val200, test."""

    data_root: str | None = field(default=None, metadata={"help": "folder holding one folder per registry task "
                                                                  "(DIR/<task>/{train800,val200,test}); all 19 are expected"})
    task: list[str] = field(default_factory=list, metadata={"help": "NAME=DIR, repeatable: a registry task, or "
                                                                    "GROUP/NAME (natural, specialized, structured) of your own"})
    no_flip: list[str] = field(default_factory=list, metadata={"help": "tasks of your own where a flip changes the label"})
    no_crop: list[str] = field(default_factory=list, metadata={"help": "tasks of your own where a crop changes the label"})
    pretrained: str | None = field(default=None, metadata={"help": "model.safetensors written by pretrain; none trains from scratch"})
    variant: str = field(default="Ti/16", metadata={"help": "vitcore variant when training from scratch"})
    output: str = field(default="vtab_output", metadata={"recipe": False, "help": "results and Tune state; re-running with the same one resumes"})
    img_size: int = field(default=384, metadata={"help": "fine-tuning resolution for every task (the paper: 384)"})
    lrs: list[float] = field(default_factory=lambda: [0.001, 0.01], metadata={"help": "learning rates swept"})
    steps: list[int] = field(default_factory=lambda: [500, 2500], metadata={"help": "schedule lengths swept (SGD steps)"})
    batch_size: int = field(default=512, metadata={"help": "optimiser batch"})
    microbatch: int = field(default=0, metadata={"recipe": False, "help": "images per forward/backward (0: the whole batch)"})
    warmup_steps: int = field(default=500, metadata={"help": "linear warm-up steps; capped at 10% of the steps"})
    grad_clip: float = field(default=1.0, metadata={"help": "global gradient-norm clip; 0 disables"})
    crop_min_area: float = field(default=0.05, metadata={"help": "Inception-crop minimum area where crops are allowed"})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum"})
    layer_decay: float | None = field(default=None, metadata={"off": None, "help": "layer-wise learning-rate decay: each layer's rate is the base rate x this^(L - layer), the head at L, the patch embedding at 0 (BEiT, timm: e.g. 0.65-0.75; default: one rate for all)"})
    cpus_per_trial: int = field(default=1, metadata={"recipe": False, "help": "CPUs per trial (and torch threads)"})
    gpus_per_trial: float = field(default=0, metadata={"recipe": False, "help": "GPUs per trial; fractions share one GPU"})
    max_concurrent: int = field(default=0, metadata={"recipe": False, "help": "trials at once (0: as resources allow)"})
    max_failures: int = field(default=2, metadata={"recipe": False, "help": "retries of a failed trial"})
    bf16: bool = field(default=True, metadata={"help": "bf16 autocast on GPU (ignored on CPU)"})
    seed: int = field(default=0, metadata={"help": "seed for init, shuffling and augmentation"})
    ray_address: str | None = field(default=None, metadata={"recipe": False, "help": "Ray cluster address; default: RAY_ADDRESS or in-process"})
    parent_run_id: str | None = field(default=None, metadata={"recipe": False, "help": "MLflow run to nest under"})
    data_changed_ok: bool = field(default=False, metadata={"recipe": False, "help": "resume the sweep in --output even "
                                                                                  "though a task's split was replaced since it started"})

    def __post_init__(self) -> None:
        check(bool(self.data_root or self.task), "task", "give --data-root DIR or at least one --task NAME=DIR")
        check(len(self.lrs) > 0 and all(lr > 0 for lr in self.lrs), "lrs", f"give positive learning rates, got {self.lrs}")
        check(len(self.steps) > 0 and all(s > 0 for s in self.steps), "steps", f"give positive step counts, got {self.steps}")
        for name in ("img_size", "batch_size", "cpus_per_trial"):
            check(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        check_batching(self.batch_size, self.microbatch)
        check(0 < self.crop_min_area <= 1, "crop_min_area", f"must be in (0, 1], got {self.crop_min_area}")
        check(self.layer_decay is None or 0 < self.layer_decay <= 1, "layer_decay",
              f"must be in (0, 1] (1: one rate for all), got {self.layer_decay}")
        check(self.gpus_per_trial >= 0, "gpus_per_trial", f"must be >= 0, got {self.gpus_per_trial}")
        parse_named(self.task, "task", example="dtd=/data/vtab/dtd or natural/mytask=/data/mytask")

    def settings(self) -> list[dict]:
        return [{"lr": lr, "steps": s} for lr in self.lrs for s in self.steps]


def vtab_trial(config: dict) -> None:
    """One task at one (lr, steps). ``select``: train800 → val200; ``final``: train800val200 → test."""
    from ray import tune
    from torch.utils.data import ConcatDataset, DataLoader

    from training.data import ShardImageDataset, eval_transform, train_transform
    from training.loop import evaluate

    cfg = VtabConfig(**config["cfg"])
    name, setting, phase = config["task"], config["setting"], config["phase"]
    task = config["tasks"][name]
    device = start_trial(cfg.cpus_per_trial, cfg.gpus_per_trial, cfg.seed)
    uri = config["mlflow_uri"]
    run_id = tracking.create_child_run(
        config["mlflow_parent"], f"{phase} {name} lr={setting['lr']:g} steps={setting['steps']}",
        stage=f"vtab-{phase}", params={"task": name, "group": task["group"], "phase": phase, **setting}, uri=uri)
    try:
        model = load_backbone(cfg.pretrained, cfg.variant, cfg.img_size, task["num_classes"]).to(device)
        size = model.config.img_size[0]
        augment = train_transform(size, flip=task["flip"], min_area=cfg.crop_min_area if task["crop"] else 1.0)
        root = Path(task["dir"])
        parts = ["train800"] + (["val200"] if phase == "final" else [])
        train_ds = ConcatDataset([ShardImageDataset(root / p, augment, seed=cfg.seed) for p in parts])
        eval_split = "val200" if phase == "select" else "test"
        eval_loader = DataLoader(ShardImageDataset(root / eval_split, eval_transform(size)), batch_size=256)
        spec = TrainSpec(lr=setting["lr"], steps=setting["steps"], batch_size=cfg.batch_size,
                         microbatch=cfg.microbatch, warmup_steps=cfg.warmup_steps, grad_clip=cfg.grad_clip,
                         momentum=cfg.momentum, layer_decay=cfg.layer_decay, bf16=cfg.bf16, seed=cfg.seed)
        evaluated, stats = train_sgd(model, train_ds, spec, device)
        result = evaluate(evaluated, eval_loader, device, cfg.bf16)
        key = "val" if phase == "select" else "test"
        metrics = {f"{key}_accuracy": result["accuracy"], f"{key}_loss": result["loss"],
                   "train_loss": stats["train_loss"], "train_rows": len(train_ds),
                   "images_per_second": stats["images_per_second"]}
        tracking.log_metrics_to(run_id, metrics, step=setting["steps"], uri=uri)
        if phase == "final":
            report_final(metrics, evaluated, train_ds.datasets[0].shards.label_names)
        else:
            tune.report(metrics)
        tracking.end_run(run_id, uri=uri)
    except BaseException:
        tracking.end_run(run_id, failed=True, uri=uri)
        raise


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def choose_setting(val: dict[tuple, dict[str, float]], task_names: list[str], settings: list[dict]) -> tuple[dict, list]:
    """The setting with the highest mean val200 accuracy over every task (ties: the earlier one).

    ``val[(lr, steps)][task]`` are the selection trials' val200 accuracies; a setting missing a
    task (its trial failed after its retries) cannot be compared and is left out.
    """
    table = []
    for s in settings:
        accs = val.get((s["lr"], s["steps"]), {})
        complete = all(t in accs for t in task_names)
        table.append({**s, "mean_val_accuracy": mean(accs[t] for t in task_names) if complete else None,
                      "val_accuracy": {t: accs.get(t) for t in task_names}})
    scored = [row for row in table if row["mean_val_accuracy"] is not None]
    if not scored:
        raise RuntimeError("no setting has a val200 accuracy for every task; every setting lost a trial to failures")
    best = max(scored, key=lambda r: r["mean_val_accuracy"])
    return {"lr": best["lr"], "steps": best["steps"]}, table


def aggregate(tasks: dict[str, dict], setting: dict, val: dict[str, float], test: dict[str, float]) -> dict:
    """The results as VTAB reports them: the chosen setting, per-task val/test (with the task's label
    map, so its class ids can be read), the mean of each group and the mean over every task."""
    per_task = {n: {"group": tasks[n]["group"], "label_map": tasks[n]["label_map"], "val_accuracy": val[n],
                    "test_accuracy": test[n]} for n in tasks}
    groups = {g: mean(r["test_accuracy"] for r in per_task.values() if r["group"] == g)
              for g in GROUPS if any(r["group"] == g for r in per_task.values())}
    return {"setting": dict(setting), "tasks": per_task, "groups": groups,
            "mean": mean(r["test_accuracy"] for r in per_task.values())}


def format_table(results: dict) -> str:
    s = results["setting"]
    lines = [f"VTAB-1k (setting lr={s['lr']:g}, steps={s['steps']}, chosen by mean val200 accuracy)",
             f"  {'group':<12} {'task':<22} {'val200':>7} {'test':>7}"]
    for g in GROUPS:
        for name, r in results["tasks"].items():
            if r["group"] == g:
                lines.append(f"  {g:<12} {name:<22} {r['val_accuracy']:>7.3f} {r['test_accuracy']:>7.3f}")
    for g, m in results["groups"].items():
        lines.append(f"  {g + ' mean':<35} {m:>7.3f}")
    lines.append(f"  {'VTAB mean (over tasks)':<35} {results['mean']:>7.3f}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Bars of test accuracy per task, grouped by VTAB group, with each group's mean: the report's
    VTAB figure given this one run."""
    s = results["setting"]
    title = f"VTAB-1k: mean {results['mean']:.3f} (lr {s['lr']:g}, {s['steps']} steps)"
    plots.write(plots.vtab_bars([{**results, "label": "test accuracy"}], title=title), path)


def _sweep(cfg: VtabConfig, space: dict, name: str, output: Path, metric: str):
    return tune_sweep(vtab_trial, space, name=name, output=output,
                      resources=trial_resources(cfg.cpus_per_trial, cfg.gpus_per_trial), metric=metric,
                      max_concurrent=cfg.max_concurrent, max_failures=cfg.max_failures,
                      label=("task", "setting.lr", "setting.steps"), prog="vtab")


def _select(cfg: VtabConfig, common: dict, output: Path, names: list[str]) -> tuple[dict, list[dict]]:
    """The selection sweep's val200 accuracies, ``val[(lr, steps)][task]``, and its failed trials."""
    from ray import tune

    grid = _sweep(cfg, {"task": tune.grid_search(names), "setting": tune.grid_search(cfg.settings()),
                        "phase": "select", **common}, "select", output, "val_accuracy")
    val: dict[tuple, dict[str, float]] = {}
    failed = []
    for r in grid:
        s = r.config["setting"]
        if r.error or not r.metrics or "val_accuracy" not in r.metrics:
            failed.append({"task": r.config["task"], **s, "error": str(r.error)})
            continue
        val.setdefault((s["lr"], s["steps"]), {})[r.config["task"]] = r.metrics["val_accuracy"]
    return val, failed


def _final(cfg: VtabConfig, common: dict, output: Path, names: list[str], setting: dict) -> dict[str, float]:
    """Each task's test accuracy after fine-tuning on train800val200 at ``setting``."""
    from ray import tune

    final = _sweep(cfg, {"task": tune.grid_search(names), "setting": setting, "phase": "final", **common},
                   "final", output, "test_accuracy")
    test = {}
    for r in final:
        if r.error or not r.metrics or "test_accuracy" not in r.metrics:
            raise RuntimeError(f"the final fine-tune of task {r.config['task']} on train800val200 failed: {r.error}")
        test[r.config["task"]] = r.metrics["test_accuracy"]
    return test


def _publish(results: dict, sweep: list[dict], failed: list[dict], output: Path) -> None:
    """The results, the sweep's table, the chart and the metrics, in ``output`` and in MLflow."""
    atomic_write(str(output / RESULTS_FILE), json.dumps(results, indent=2))
    atomic_write(str(output / "vtab_sweep.json"), json.dumps({"settings": sweep, "failed": failed}, indent=2))
    plot(results, output / CHART_FILE)
    table = format_table(results)
    setting = results["setting"]
    tracking.log_metrics({"vtab_mean": results["mean"], "lr": setting["lr"], "steps": setting["steps"],
                          **{f"vtab_{g}": m for g, m in results["groups"].items()},
                          **{f"test_accuracy.{n}": r["test_accuracy"] for n, r in results["tasks"].items()}})
    for f in (RESULTS_FILE, CHART_FILE, "vtab_sweep.json"):
        tracking.log_artifact(output / f)
    tracking.log_text(table, "vtab_results.txt")


def run_vtab(cfg: VtabConfig) -> dict[str, Any]:
    """Sweep the settings on every task's train800 (scored on val200), choose the best mean, test each task at it."""
    if cfg.pretrained:
        cfg = dataclasses.replace(cfg, pretrained=str(pretrained_file(cfg.pretrained)))
    # Before Ray starts: a missing task costs nothing.
    tasks = resolve_tasks(cfg.data_root, cfg.task, no_flip=cfg.no_flip, no_crop=cfg.no_crop)
    output = Path(durable_path(cfg.output, "output")).expanduser().resolve()
    # One sweep at a time in an output folder: two would restore the same sweep and run its trials twice.
    check_owner(output, "vtab")
    # The tasks' splits stay as they are for the sweep: a prepare replacing one is refused.
    with reading("vtab", split_dirs(tasks)), FolderLock(make_output_dir(output), "vtab"):
        claim_folder(output, "vtab")
        return _run_sweeps(cfg, output, tasks)


def _run_sweeps(cfg: VtabConfig, output: Path, tasks: dict[str, dict]) -> dict[str, Any]:
    config = dataclasses.asdict(cfg)
    records, main = task_records(tasks)
    data = manifest_digests({r["name"]: r for r in records})
    state = open_sweep_state(output, config, stage="vtab", fresh_keys=not_recipe(cfg), data=data,
                             data_changed_ok=cfg.data_changed_ok)
    init_ray(cfg.ray_address)
    uri = tracking.tracking_uri()
    names = list(tasks)
    upstream = [u for u in ([tracking.read_lineage(cfg.pretrained)] if cfg.pretrained else []) if u]
    name = f"vtab {len(names)} tasks" + (f" from {Path(cfg.pretrained).parent.name}" if cfg.pretrained else "")
    new = {"params": {**config, "tasks": names}, "parent_run_id": cfg.parent_run_id, "run_name": name,
           "tags": tracking.run_tags(cfg, data=records, main=main, models=upstream)}
    with sweep_run("vtab", output, config, state, records=records, new=new, data=data) as run:
        common = {"cfg": config, "tasks": tasks, "mlflow_parent": run.info.run_id, "mlflow_uri": uri}
        val, failed = _select(cfg, common, output, names)
        setting, sweep = choose_setting(val, names, cfg.settings())
        test = _final(cfg, common, output, names, setting)
        results = aggregate(tasks, setting, val[(setting["lr"], setting["steps"])], test)
        _publish(results, sweep, failed, output)
    return {**results, "sweep": sweep, "failed": failed, "output": str(output), "mlflow_run_id": run.info.run_id}
