"""Few-shot linear evaluation over VTAB-style task folders (Section 4.1, "Metrics").

"Few-shot accuracies are obtained by solving a regularized least-squares regression problem that
maps the (frozen) representation of a subset of training images to {−1, 1}^K target vectors."
The frozen representation is the pre-trained model's pre-logits (big_vision's default), computed
once per task for its training pool (train800 + val200) and its test split; then for each shot
count and each random draw the closed-form classifier of :mod:`vitcore.fewshot` is fit on that
many images per class and scored on test. Shot counts a task cannot supply (a class with fewer
images than that in the pool) are reported as skipped, with the reason.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import field
from pathlib import Path
from typing import Any

import numpy as np

from common import tracking
from common.config import check
from common.fs import atomic_write
from common.jobenv import durable_path
from common.locks import reading
from common.progress import ProgressLine, duration, eta_text
from transfer.sgd import pretrained_file
from transfer.vtab_data import resolve_tasks, split_dirs, task_records
from transfer.vtab_tasks import GROUPS

RESULTS_FILE = "fewshot_results.json"


@dataclasses.dataclass
class FewshotConfig:
    """Few-shot linear evaluation of a pre-trained ViT's frozen pre-logits on VTAB-style task folders."""

    pretrained: str = field(metadata={"help": "model.safetensors written by pretrain"})
    data_root: str | None = field(default=None, metadata={"help": "folder with one folder per registry task; all 19 expected"})
    task: list[str] = field(default_factory=list, metadata={"help": "NAME=DIR, repeatable (as jobs/vtab.py)"})
    output: str = field(default="fewshot_output", metadata={"recipe": False, "help": "directory for fewshot_results.json"})
    shots: list[int] = field(default_factory=lambda: [1, 5, 10, 25], metadata={"help": "images per class"})
    draws: int = field(default=5, metadata={"help": "random draws of the shots per shot count"})
    l2_reg: float = field(default=2.0 ** 10, metadata={"help": "ridge regularisation (big_vision: 2^10)"})
    representation: str = field(default="pre_logits", metadata={"help": "which intermediate to use as features"})
    img_size: int | None = field(default=None, metadata={"help": "evaluation resolution; default: the model's own"})
    batch_size: int = field(default=128, metadata={"recipe": False, "help": "images per forward pass when computing features"})
    device: str = field(default="auto", metadata={"recipe": False, "help": "auto (cuda if present), cuda or cpu"})
    seed: int = field(default=0, metadata={"help": "first seed of the draws"})
    parent_run_id: str | None = field(default=None, metadata={"recipe": False, "help": "MLflow run to nest under"})

    def __post_init__(self) -> None:
        check(bool(self.data_root or self.task), "task", "give --data-root DIR or at least one --task NAME=DIR")
        check(len(self.shots) > 0 and all(s > 0 for s in self.shots), "shots", f"must be positive, got {self.shots}")
        check(self.draws > 0, "draws", f"must be positive, got {self.draws}")
        check(self.l2_reg > 0, "l2_reg", f"must be positive, got {self.l2_reg}")
        check(self.batch_size > 0, "batch_size", f"must be positive, got {self.batch_size}")


def features(model, shard_dirs: list[Path], size: int, batch_size: int, key: str) -> tuple[np.ndarray, np.ndarray]:
    """Frozen ``key`` features and labels of every row of the given shard sets."""
    from torch.utils.data import ConcatDataset, DataLoader

    from training.data import ShardImageDataset, eval_transform
    from vitcore.fewshot import compute_representations

    ds = ConcatDataset([ShardImageDataset(d, eval_transform(size)) for d in shard_dirs])
    labels: list[np.ndarray] = []

    def images():
        for x, y in DataLoader(ds, batch_size=batch_size):
            labels.append(y.numpy())
            yield x

    feats = compute_representations(model, images(), key=key)
    return feats, np.concatenate(labels).astype(np.int64)


def evaluate_task(train_x, train_y, test_x, test_y, num_classes: int, shots: list[int], seeds: list[int],
                  l2_reg: float) -> dict[str, dict]:
    """``{shots: {"mean", "std", "per_draw"}}`` for each shot count, or ``{"skipped": reason}``."""
    from vitcore.fewshot import fewshot_accuracy

    counts = np.bincount(train_y, minlength=num_classes)
    out = {}
    for k in shots:
        if counts.min() < k:
            c = int(counts.argmin())
            out[str(k)] = {"skipped": f"class {c} has {int(counts[c])} images in the pool, fewer than {k}"}
            continue
        r = fewshot_accuracy(train_x, train_y, test_x, test_y, num_classes=num_classes, shots=[k], seeds=seeds,
                             l2_reg=l2_reg)[k]
        out[str(k)] = {"mean": r["mean"], "std": r["std"], "per_draw": r["per_seed"]}
    return out


def aggregate(per_task: dict[str, dict], shots: list[int]) -> tuple[dict, dict]:
    """Group means and the overall mean per shot count, over the tasks that have that shot count."""
    def mean_of(names):
        vals = {}
        for k in map(str, shots):
            xs = [per_task[n]["shots"][k]["mean"] for n in names if "mean" in per_task[n]["shots"][k]]
            vals[k] = float(np.mean(xs)) if xs else None
        return vals

    groups = {g: mean_of([n for n, r in per_task.items() if r["group"] == g])
              for g in GROUPS if any(r["group"] == g for r in per_task.values())}
    return groups, mean_of(list(per_task))


def format_table(results: dict) -> str:
    shots = results["shots"]
    head = "".join(f"{k + '-shot':>16}" for k in map(str, shots))
    lines = [f"Few-shot linear evaluation ({results['draws']} draws; mean ± std of test top-1)",
             f"  {'group':<12} {'task':<22}{head}"]

    def cell(r):
        return f"{'skipped':>16}" if "mean" not in r else f"{r['mean']:>9.3f} ± {r['std']:.3f}"

    for g in GROUPS:
        for name, r in results["tasks"].items():
            if r["group"] == g:
                lines.append(f"  {g:<12} {name:<22}" + "".join(cell(r["shots"][k]) for k in map(str, shots)))
    for g, m in list(results["groups"].items()) + [("all", results["mean"])]:
        lines.append(f"  {g + ' mean':<35}" + "".join(f"{'-':>16}" if m[k] is None else f"{m[k]:>16.3f}"
                                                     for k in map(str, shots)))
    return "\n".join(lines)


def run_fewshot(cfg: FewshotConfig) -> dict[str, Any]:
    path = pretrained_file(cfg.pretrained)
    tasks = resolve_tasks(cfg.data_root, list(cfg.task))
    # The tasks' splits stay as they are for the run: a prepare replacing one is refused.
    with reading("fewshot", split_dirs(tasks)):
        return _evaluate(cfg, path, tasks)


def _evaluate(cfg: FewshotConfig, path: Path, tasks: dict[str, dict]) -> dict[str, Any]:
    import torch

    import vitcore

    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    model = vitcore.load_checkpoint(path, **({"img_size": cfg.img_size} if cfg.img_size else {})).to(device).eval()
    size = model.config.img_size[0]
    seeds = list(range(cfg.seed, cfg.seed + cfg.draws))
    output = Path(durable_path(cfg.output, "output")).expanduser().resolve()
    output.mkdir(parents=True, exist_ok=True)
    per_task = {}
    line = ProgressLine("fewshot")
    t_start = time.perf_counter()
    records, main = task_records(tasks)
    upstream = [u for u in [tracking.read_lineage(path)] if u]
    config = dataclasses.asdict(cfg)
    with tracking.start_run("fewshot", params={**config, "tasks": list(tasks)}, parent_run_id=cfg.parent_run_id,
                            run_name=f"fewshot {len(tasks)} tasks from {path.parent.name}",
                            tags=tracking.run_tags(cfg, data=records, main=main, models=upstream)) as run:
        tracking.log_shard_inputs(records, context="evaluation")
        for i, (name, t) in enumerate(tasks.items()):
            root = Path(t["dir"])
            t0 = time.perf_counter()
            line.update(f"task {name} ({i + 1}/{len(tasks)}): RUNNING, extracting features"
                        + eta_text(i, len(tasks), t0 - t_start), force=True)
            # Once per task: every shot count and draw reuses these features.
            train_x, train_y = features(model, [root / "train800", root / "val200"], size, cfg.batch_size,
                                        cfg.representation)
            test_x, test_y = features(model, [root / "test"], size, cfg.batch_size, cfg.representation)
            feature_s = time.perf_counter() - t0
            shots = evaluate_task(train_x, train_y, test_x, test_y, t["num_classes"], list(cfg.shots), seeds,
                                  cfg.l2_reg)
            per_task[name] = {"group": t["group"], "label_map": t["label_map"], "shots": shots}
            line.above(f"task {name} ({i + 1}/{len(tasks)}): done in {duration(time.perf_counter() - t0)}, "
                       + ", ".join(f"{k}-shot accuracy {r['mean']:.3f}" for k, r in shots.items() if "mean" in r))
            with tracking.start_run("fewshot-task", run_name=f"fewshot {name}", parent_run_id=run.info.run_id,
                                    params={"task": name, "group": t["group"], "pool": len(train_y),
                                            "test": len(test_y)}):
                tracking.log_metrics({"feature_seconds": feature_s,
                                      **{f"{k}shot_mean": r["mean"] for k, r in shots.items() if "mean" in r},
                                      **{f"{k}shot_std": r["std"] for k, r in shots.items() if "mean" in r}})
        groups, overall = aggregate(per_task, list(cfg.shots))
        results = {"shots": list(cfg.shots), "draws": cfg.draws, "representation": cfg.representation,
                   "tasks": per_task, "groups": groups, "mean": overall}
        atomic_write(str(output / RESULTS_FILE), json.dumps(results, indent=2))
        table = format_table(results)
        tracking.log_metrics({f"{k}shot_mean": v for k, v in overall.items() if v is not None})
        tracking.log_artifact(output / RESULTS_FILE)
        tracking.log_text(table, "fewshot_results.txt")
    return {**results, "output": str(output), "mlflow_run_id": run.info.run_id}
