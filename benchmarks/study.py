"""What a scaling study costs beyond the pre-training runs it is made of.

Builds a small corpus as the demo does (drawn shapes and crops of the bundled photographs, and
scikit-learn's digits as the few-shot set), ingests it, then in this one process, on one Ray
session started before anything is timed:

- the study on the grid (``--models`` x ``--fractions``, ``--budget steps``), as ``jobs/study.py``
  runs it (``common.cli.run_job`` on its argv), timed whole: its input checks, parent run, every
  cell, the table and both figures (``study_s``);
- the same cells as plain pre-training runs, one after another, as ``jobs/pretrain.py`` runs them,
  each given the cell's own config as ``--config FILE`` (``sum_of_runs_s``).

With ``--rounds 2`` (the default) the second round runs them in the other order, so neither side
alone gets a warm process; each round writes into fresh folders. The last line printed is one JSON
object: ``study_s``, ``sum_of_runs_s`` and ``ratio`` summed over the rounds, and each round's.

    python benchmarks/study.py [--models Ti/8,BiT-mu] [--fractions 0.5,1] [--steps 20]
                               [--fewshot-every 10] [--per-shape 20] [--per-photo 8] [--rounds 2] [--keep DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import machine  # noqa: E402

RECIPE = REPO / "configs" / "pretrain-demo-tiny.yaml"


def build_shards(work: Path, per_shape: int, per_photo: int) -> tuple[Path, Path]:
    """The corpus and the digits' training split as shard sets (the demo's generators, one Beam worker)."""
    from demo import data as demo_data
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    data = demo_data.build(work / "data", per_shape=per_shape, per_photo=per_photo, train_images=300, test_images=100)
    out = {}
    for name, folder in (("corpus", data.corpus), ("digits-train", data.train)):
        out[name] = work / "shards" / name
        run_prepare(PrepareConfig(input=[str(folder)], output=str(out[name]), size=48, workers=1))
    return out["corpus"], out["digits-train"]


def study_argv(args, corpus: Path, fewshot: Path, output: Path) -> list[str]:
    return ["--data", str(corpus), "--fewshot-data", str(fewshot), "--config", str(RECIPE), "--models", args.models,
            "--fractions", args.fractions, "--budget", "steps", "--steps", str(args.steps),
            "--fewshot-every", str(args.fewshot_every), "--output", str(output)]


def timed(run_job, cls, runner, argv: list[str], prog: str) -> float:
    t = time.perf_counter()
    rc = run_job(cls, runner, argv, prog=prog)
    if rc != 0:
        raise SystemExit(f"benchmark: {prog} exited {rc}; see its error above")
    return time.perf_counter() - t


def run_study(argv: list[str]) -> float:
    """What ``jobs/study.py`` runs (benchmarks import no entrypoint)."""
    from common.cli import run_job
    from reports.study import run_and_draw
    from training.study import StudyConfig

    return timed(run_job, StudyConfig, run_and_draw, argv, "study")


def run_cells(argv: list[str], output: Path) -> list[float]:
    """Each cell of the study ``argv`` describes, as ``jobs/pretrain.py --config CELL.json`` (its own config)."""
    from common.cli import parse_args, run_job
    from training.pretrain import PretrainConfig, run_pretrain
    from training.study import StudyConfig, cell_configs, cell_name

    walls = []
    for cell in cell_configs(parse_args(StudyConfig, argv, prog="study")):
        name = cell_name(cell.variant, cell.fraction)
        config = {k: v for k, v in dataclasses.asdict(cell).items() if k not in ("output", "parent_run_id")}
        path = output / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config))
        # What jobs/pretrain.py runs.
        walls.append(timed(run_job, PretrainConfig, run_pretrain, ["--config", str(path), "--output", str(output / name)],
                           "pretrain"))
    return walls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="Ti/8,BiT-mu")
    p.add_argument("--fractions", default="0.5,1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--fewshot-every", type=int, default=10)
    p.add_argument("--per-shape", type=int, default=20)
    p.add_argument("--per-photo", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--keep", help="work in this folder and keep it (default: a temporary one, removed)")
    args = p.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="vitscale-study-bench-")).resolve()
    os.environ["VITSCALE_HOME"] = str(work / "mlruns")
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        corpus, fewshot = build_shards(work, args.per_shape, args.per_photo)
        from training.ray_utils import init_ray

        init_ray()
        rounds = []
        for i in range(args.rounds):
            argv = study_argv(args, corpus, fewshot, work / f"round{i}" / "study")
            if i % 2 == 0:
                runs = run_cells(argv, work / f"round{i}" / "runs")
                study = run_study(argv)
            else:
                study = run_study(argv)
                runs = run_cells(argv, work / f"round{i}" / "runs")
            rounds.append({"order": "runs, study" if i % 2 == 0 else "study, runs", "study_s": round(study, 2),
                           "sum_of_runs_s": round(sum(runs), 2), "runs_s": [round(w, 2) for w in runs],
                           "ratio": round(study / sum(runs), 3)})
            print(f"round {i + 1}: {json.dumps(rounds[-1])}", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    study_s, runs_s = sum(r["study_s"] for r in rounds), sum(r["sum_of_runs_s"] for r in rounds)
    print(json.dumps({"study_s": round(study_s, 2), "sum_of_runs_s": round(runs_s, 2),
                      "ratio": round(study_s / runs_s, 3), "target": 1.10, "rounds": rounds,
                      "grid": {"models": args.models, "fractions": args.fractions, "steps": args.steps,
                               "fewshot_every": args.fewshot_every},
                      "machine": machine.describe(), "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
