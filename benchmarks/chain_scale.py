"""The chain after the ingest against corpus size: dedup, one epoch of pre-training, ShardSet reads.

The question is whether any step downstream of ``prepare`` holds memory that grows with the
corpus. Per corpus size this ingests N photo crops (the corpora of ``ingest_scale.py``, the
same ``prepare --size 256`` on the DirectRunner), then runs on that shard set, each as a
subprocess whose whole process tree is sampled every 0.5 s:

- ``jobs/dedup.py`` against one test set of ``--test-size`` images: procedural colour fields
  (not crops: those the near-duplicate rule matches), and ``--planted`` re-encoded, 90 %-scaled
  copies of corpus images (drawn from the smallest corpus, so every size holds them) to find;
- ``jobs/pretrain.py --config configs/pretrain-demo-tiny.yaml`` (a 4-block Ti/8 at 32 px, two
  Ray workers) for one epoch, or ``--pretrain-steps`` optimiser steps;
- a ``ShardSet`` probe: open, the first row (which verifies the shard's sha256), then
  ``--rows`` random rows; it reports its own timings and its resident set by kind of memory
  before and after (the file-backed part is the memory-mapped shards).

The dedup writes ``removed.jsonl``, so the pre-training and the probe read the set as a user
would after it. Between the two largest sizes each step's peak gives a growth in KB per input,
of the resident set and of each of its parts (anonymous, shared memory, file-backed, and the
proportional set: :data:`ingest_scale.KINDS`), beside the ingest's own from the same run.

    python benchmarks/chain_scale.py [--sizes 20000,80000] [--test-size 10000] [--planted 20]
                                     [--pretrain-steps N] [--keep DIR]

Before it, on stderr, a table of the peaks by kind of memory. The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import ingest_scale  # noqa: E402
import machine  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from PIL import Image  # noqa: E402

PRETRAIN_CONFIG = REPO / "configs" / "pretrain-demo-tiny.yaml"


def write_textures(folder: Path, n: int, seed: int = 1) -> None:
    """``n`` procedural JPEGs, 160-400 px: smooth colour fields with grain, unlike any photograph.

    Not crops of the corpus's photographs: the near-duplicate rule matches crops, so a
    crop of the same photograph is a duplicate (a first run found 94 % of the corpus in such
    a test set).
    """
    rng = np.random.default_rng(seed)
    out = folder / "fresh"
    out.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        w, h = (int(v) for v in rng.integers(160, 401, 2))
        cells = rng.integers(0, 256, (int(rng.integers(3, 12)), int(rng.integers(3, 12)), 3), dtype=np.uint8)
        field = np.asarray(Image.fromarray(cells).resize((w, h), Image.Resampling.BICUBIC), np.float32)
        grain = rng.normal(0, 12, field.shape)
        Image.fromarray(np.clip(field + grain, 0, 255).astype(np.uint8)).save(out / f"{i:07d}.jpg", "JPEG", quality=90)


def make_test_set(folder: Path, corpus: list[Path], n: int, planted: int, seed: int = 1) -> Path:
    """``n - planted`` procedural images and ``planted`` near-copies (90 %, JPEG q75) of ``corpus`` files."""
    write_textures(folder, n - planted, seed=seed)
    for p in random.Random(seed).sample(corpus, planted):
        img = Image.open(p).convert("RGB")
        out = folder / "planted" / p.name
        out.parent.mkdir(parents=True, exist_ok=True)
        img.resize((round(img.width * 0.9), round(img.height * 0.9)), Image.Resampling.BILINEAR).save(
            out, "JPEG", quality=75)
    return folder


def _rss(proc: psutil.Process) -> dict:
    return {f"{kind}_mb": round(v / 2**20) for kind, v in ingest_scale.memory_by_kind(proc.pid).items()}


def probe_shards(directory: str, rows: int) -> dict:
    """Open a shard set and read ``rows`` random rows, in this process: timings and resident set."""
    from pipelines.schema import ShardSet

    me = psutil.Process()
    out = {"before": _rss(me)}
    t = time.perf_counter()
    ss = ShardSet(directory)
    out["open_s"] = round(time.perf_counter() - t, 3)
    out["after_open"] = _rss(me)
    t = time.perf_counter()
    ss[0]
    out["first_row_s"] = round(time.perf_counter() - t, 3)
    picks = random.Random(0).sample(range(len(ss)), min(rows, len(ss)))
    t = time.perf_counter()
    for i in picks:
        ss[i]
    dt = time.perf_counter() - t
    out.update(rows=len(ss), random_rows=len(picks), random_rows_per_s=round(len(picks) / dt, 1),
               after_rows=_rss(me), peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    return out


def run_dedup(shards: Path, test_set: Path, env: dict) -> dict:
    cmd = [sys.executable, str(REPO / "jobs" / "dedup.py"), "--shards", str(shards), "--test-set", f"test={test_set}"]
    out, wall, sampler = ingest_scale.run_sampled(cmd, env)
    summary = json.loads(out.strip().splitlines()[-1])
    removed = [json.loads(line) for line in (shards / "removed.jsonl").read_text().splitlines() if line.strip()]
    planted = {r["test_uri"] for r in removed if "/planted/" in r.get("test_uri", "")}
    return {"wall_s": round(wall, 1), **ingest_scale.peaks(sampler), "rows_scanned": summary["rows_scanned"],
            "test_images": summary["test_images"], "removed": summary["new_removals"], "planted_found": len(planted)}


def run_pretrain(shards: Path, output: Path, env: dict, steps: int | None) -> dict:
    cmd = [sys.executable, str(REPO / "jobs" / "pretrain.py"), "--config", str(PRETRAIN_CONFIG), "--data", str(shards),
           "--output", str(output), "--progress-every", "0"]
    cmd += ["--steps", str(steps)] if steps else ["--epochs", "1"]
    _, wall, sampler = ingest_scale.run_sampled(cmd, env)
    summary = json.loads((output / "pretrain_summary.json").read_text())
    pos = summary["data_position"]
    return {"wall_s": round(wall, 1), **ingest_scale.peaks(sampler), "steps": summary["steps"],
            "epochs_done": pos["epoch"], "rows_seen_in_epoch": pos["rows_seen_in_epoch"]}


def run_probe(shards: Path, env: dict, rows: int) -> dict:
    """The probe's own figures (too short a run for the sampler): its ``ru_maxrss``, and by kind after the rows."""
    cmd = [sys.executable, __file__, "--probe", str(shards), "--rows", str(rows)]
    out, wall, _ = ingest_scale.run_sampled(cmd, env)
    probe = json.loads(out.strip().splitlines()[-1])
    after = {f"peak_{kind}_mb": probe["after_rows"][f"{kind}_mb"] for kind in ingest_scale.KINDS if kind != "rss"}
    return {"wall_s": round(wall, 1), **after, **probe}


def chain(n: int, corpus: Path, test_set: Path, tmp: Path, args) -> dict:
    shards, env = tmp / f"shards-{n}", ingest_scale.job_env(REPO, tmp / "home")
    run = {"ingest": ingest_scale.run_prepare(REPO, corpus, shards, tmp / "home", "DirectRunner", args.workers,
                                              args.size)}
    run["ingest"].pop("shard_sha256")
    run["dedup"] = run_dedup(shards, test_set, env)
    run["pretrain"] = run_pretrain(shards, tmp / f"pretrain-{n}", env, args.pretrain_steps)
    run["shardset"] = run_probe(shards, env, args.rows)
    return run


def growth(runs: dict[int, dict], kind: str = "rss") -> dict:
    """Each step's growth of its peak ``kind`` of memory, in KB per input, between the two largest sizes."""
    if len(runs) < 2:
        return {}
    a, b = sorted(runs)[-2:]
    key = f"peak_{kind}_mb"
    return {step: round((runs[b][step][key] - runs[a][step][key]) * 1024 / (b - a), 2) for step in runs[b]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="80000", help="corpus sizes, comma-separated; two give a slope")
    ap.add_argument("--test-size", type=int, default=10_000, help="images in the dedup test set")
    ap.add_argument("--planted", type=int, default=20, help="of which near-copies of corpus images")
    ap.add_argument("--workers", type=int, default=2, help="prepare --workers")
    ap.add_argument("--size", type=int, default=256, help="prepare --size")
    ap.add_argument("--pretrain-steps", type=int, default=None, help="bound pre-training by steps, not one epoch")
    ap.add_argument("--rows", type=int, default=2000, help="random rows the ShardSet probe reads")
    ap.add_argument("--keep", type=Path, default=None, help="generate the corpora and test set here and keep them")
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # the ShardSet probe's own process
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe_shards(args.probe, args.rows)))
        return
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if not 0 <= args.planted <= min(args.test_size, sizes[0]):
        ap.error(f"--planted {args.planted}: give at most --test-size and the smallest corpus size")

    with tempfile.TemporaryDirectory(prefix="vitscale-chain-scale-") as tmp:
        tmp = Path(tmp)
        root = args.keep or tmp / "corpus"
        corpora = ingest_scale.make_corpora(root, sizes)
        test_set = root / f"textures-{args.test_size}-{args.planted}"
        if not test_set.is_dir():
            part = root / f".partial-test-{os.getpid()}"
            make_test_set(part, sorted(corpora[sizes[0]].rglob("*.jpg")), args.test_size, args.planted)
            part.rename(test_set)
        runs = {}
        for n in sizes:
            runs[n] = chain(n, corpora[n], test_set, tmp, args)
            print(f"chain {n}: {json.dumps(runs[n])}", file=sys.stderr, flush=True)
    kinds = [k for k in ingest_scale.KINDS if k != "rss"]
    slopes = {kind: growth(runs, kind) for kind in ingest_scale.KINDS}
    rows = {f"{step} {n}": r for n, run in runs.items() for step, r in run.items()}
    print(ingest_scale.table(rows, {step: {k: slopes[k][step] for k in slopes} for step in slopes["rss"]}),
          file=sys.stderr)
    print(json.dumps({
        "benchmark": "chain_scale", "figure": "growth_kb_per_input", "size": args.size, "workers": args.workers,
        "test_size": args.test_size, "planted": args.planted, "pretrain_config": PRETRAIN_CONFIG.name,
        "pretrain_steps": args.pretrain_steps, "sizes": {str(n): r for n, r in runs.items()},
        "growth_kb_per_input": slopes["rss"], **{f"growth_{k}_kb_per_input": slopes[k] for k in kinds},
        "baseline": "ingest (the same run's prepare)",
        "load_average": [round(x, 2) for x in os.getloadavg()], "machine": machine.describe(),
    }))


if __name__ == "__main__":
    main()
