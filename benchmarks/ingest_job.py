"""Whole-job ingest throughput: ``jobs/prepare.py`` on a folder of 2 MP photos, against a process pool.

``benchmarks/ingest.py`` measures the per-image path on one core. This one measures what a
user waits for: the Beam job (DirectRunner, one worker process per core) reading files,
decoding, validating, hashing, signing, resizing, encoding, de-duplicating and writing Arrow
shards and a manifest. The baseline is the hand-written alternative, run in the same
process on the same files: a ``multiprocessing.Pool`` of as many processes, each reading a
file, ``Image.open -> convert('RGB') -> resize(BICUBIC)`` and encoding JPEG at the same
quality, with no validation, de-duplication or shard writing.

Every photo is distinct (different grain), so nothing is dropped as a duplicate. The job
has a fixed start-up cost (interpreter, Beam, worker processes, MLflow) of several seconds,
so it runs twice, on a quarter of the photos and on all of them, after a one-image warm-up
run: ``job_img_s_marginal`` is the rate the extra photos were processed at, which is what a
large corpus sees, and ``job_startup_s`` is what is left of the small run's time.
``job_peak_rss_mb`` is the largest resident set of the runner or any Beam worker during the
full run: with the images kept out of the shuffle (``pipelines/spill.py``) it grows with the
number of records, not with their bytes.

``runners`` compares the DirectRunner with ``--runner dask`` (a local ``dask.distributed``
cluster the job starts, one single-threaded worker process each) at each ``--compare`` worker
count: one run of all the photos each, after a one-image warm-up. ``img_s`` is the photos over
the job's own pipeline time (MLflow ``wall_s``: Beam's workers or the Dask workers' first
imports included); ``startup_s`` is the rest of the job's wall time (interpreter, imports,
MLflow, and for Dask starting the cluster, given apart as ``cluster_startup_s``). Each run must
give the main run's shards.

    python benchmarks/ingest_job.py [--n 400] [--megapixels 2] [--workers N] [--compare 1,2]

The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import machine  # noqa: E402
import numpy as np  # noqa: E402
from ingest import _sources  # noqa: E402
from PIL import Image  # noqa: E402

from common import tracking  # noqa: E402
from pipelines.process import target_size  # noqa: E402
from pipelines.schema import MANIFEST  # noqa: E402


def write_photos(folder: Path, n: int, megapixels: float) -> list[Path]:
    """``n`` distinct camera-like JPEGs: real photographs enlarged, each with its own grain."""
    rng = np.random.default_rng(0)
    bases = []
    for src in _sources():
        aspect = src.width / src.height
        h = int(round((megapixels * 1e6 / aspect) ** 0.5))
        bases.append(np.asarray(src.resize((int(round(h * aspect)), h), Image.Resampling.BICUBIC), np.float32))
    paths = []
    for i in range(n):
        base = bases[i % len(bases)]
        grain = rng.normal(0, 6, (*base.shape[:2], 1)).astype(np.float32)
        path = folder / f"class{i % 10}" / f"{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.clip(base + grain, 0, 255).astype(np.uint8)).save(path, "JPEG", quality=92)
        paths.append(path)
    return paths


def naive_file(path: str, size: int = 384, quality: int = 90) -> int:
    img = Image.open(path).convert("RGB")
    img = img.resize(target_size(img.width, img.height, size, None, False), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return len(buf.getvalue())


def run_job(inputs: Path, output: Path, workers: int, home: Path, runner: str = "DirectRunner") -> float:
    env = dict(os.environ, VITSCALE_HOME=str(home), OMP_NUM_THREADS="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, str(REPO / "jobs" / "prepare.py"), "--input", str(inputs), "--output", str(output),
           "--workers", str(workers), "--runner", runner]
    t = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if done.returncode:
        raise SystemExit(f"prepare failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400, help="photos")
    ap.add_argument("--megapixels", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--compare", default="1,2",
                    help="worker counts at which to run the DirectRunner and a local Dask cluster side by side "
                         "('' to skip)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="vitscale-ingest-job-") as tmp:
        tmp = Path(tmp)
        paths = write_photos(tmp / "photos", args.n, args.megapixels)
        one = tmp / "one" / "c"
        one.mkdir(parents=True)
        (one / "x.jpg").write_bytes(paths[0].read_bytes())

        run_job(tmp / "one", tmp / "out-one", args.workers, tmp / "mlruns")  # warm-up: imports, page cache
        quarter = tmp / "quarter"
        for p in paths[: args.n // 4]:
            (quarter / p.parent.name).mkdir(parents=True, exist_ok=True)
            (quarter / p.parent.name / p.name).symlink_to(p)
        small = run_job(quarter, tmp / "out-quarter", args.workers, tmp / "mlruns")
        job = run_job(tmp / "photos", tmp / "out", args.workers, tmp / "mlruns")
        # The largest resident set of any finished child process so far (the runner or a Beam
        # worker): the full run's, since the earlier runs were smaller and the comparison and
        # the pool have not run.
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        manifest = json.loads((tmp / "out" / MANIFEST).read_text())
        assert manifest["counts"]["written"] == args.n, manifest["counts"]
        reference = manifest["shards"]

        # DirectRunner against a local Dask cluster (--runner dask) at the same worker counts. One
        # full run each after a one-image warm-up; the job's own clock (the MLflow metric wall_s,
        # from the pipeline's start to its end) splits its time into throughput and start-up,
        # which differencing two runs cannot do reliably on a loaded machine.
        os.environ["VITSCALE_HOME"] = str(tmp / "mlruns")
        compare: dict[str, dict[str, dict[str, float]]] = {}
        for workers in [int(w) for w in args.compare.split(",") if w.strip()]:
            for runner in ("DirectRunner", "dask"):
                key = f"{runner}_{workers}"
                run_job(tmp / "one", tmp / f"one-{key}", workers, tmp / "mlruns", runner)
                t_job = run_job(tmp / "photos", tmp / f"full-{key}", workers, tmp / "mlruns", runner)
                manifest = json.loads((tmp / f"full-{key}" / MANIFEST).read_text())
                assert manifest["shards"] == reference, f"{key}: different shards from the DirectRunner's"
                m = tracking.get_run(manifest["mlflow_run_id"]).data.metrics
                compare.setdefault("dask" if runner == "dask" else "direct", {})[str(workers)] = {
                    "img_s": round(args.n / m["wall_s"], 1),
                    "pipeline_s": round(m["wall_s"], 2),
                    "startup_s": round(t_job - m["wall_s"], 2),
                    **({"cluster_startup_s": round(m["dask_startup_s"], 2)} if runner == "dask" else {}),
                }

        t = time.perf_counter()
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            pool.map(naive_file, [str(p) for p in paths[: args.workers]])  # start the processes first
            t = time.perf_counter()
            pool.map(naive_file, [str(p) for p in paths], chunksize=4)
        pool_wall = time.perf_counter() - t

    extra = args.n - args.n // 4
    marginal = extra / max(job - small, 1e-9)
    result = {
        "benchmark": "ingest_job",
        "figure": "job_img_s_marginal",
        "baseline": "pool_img_s",
        "photos": args.n,
        "megapixels": args.megapixels,
        "workers": args.workers,
        "job_wall_s": round(job, 2),
        "job_img_s": round(args.n / job, 1),
        "job_img_s_marginal": round(marginal, 1),
        "job_startup_s": round(small - (args.n // 4) / marginal, 2),
        "job_peak_rss_mb": round(peak_mb),
        "pool_img_s": round(args.n / pool_wall, 1),
        "marginal_vs_pool": round(marginal * pool_wall / args.n, 2),
        "runners": compare,
        "machine": machine.describe(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
