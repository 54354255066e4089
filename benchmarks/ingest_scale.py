"""Ingest memory and throughput against corpus size: ``jobs/prepare.py`` on 20k, 80k and 160k photo crops.

The question is how far one machine carries the embedded default: does the peak
memory of the job grow with the number of inputs, and does the rate hold? Each corpus is N
distinct crops of the bundled photographs (:mod:`common.photos`, enlarged so that a box of
320-640 px on a side fits, JPEG quality 90), one folder per source photograph; the smaller
corpora are hard links to the first files of the largest, so every run reads the same bytes.

``prepare`` runs as a subprocess (the real entrypoint, ``--size 256``), once per size, and a
sampler reads the resident set of its whole process tree (the driver, the Beam workers or the
Dask cluster) every 0.5 s from ``/proc``, split into anonymous, shared-memory and file-backed
pages, and the proportional set (see :data:`KINDS`). Per size: the wall time, the tree's peak
of each kind of memory and the peaks of each kind of process. Between sizes: the marginal rate, the extra inputs over the
extra seconds (start-up cancels). Over the sizes: the growth of the peak with
the inputs, in KB per input, between the two largest sizes (see :func:`summarise`), of the
resident set and of each of its parts, and the peak it extrapolates to for 1.28M inputs
(ImageNet-1k).

``--baseline-repo DIR`` runs the same sizes with another checkout's ``jobs/prepare.py`` and
code (for example main before a change), in the same run and under the same load.

    python benchmarks/ingest_scale.py [--sizes 20000,80000,160000] [--runner direct|dask] [--workers 2]
                                      [--baseline-repo /path/to/checkout] [--keep DIR]

Before it, on stderr, a table of the peaks by kind of memory. The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import machine  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from PIL import Image  # noqa: E402

IMAGENET = 1_281_167
# Measured before the ingest's memory was bounded: jobs/prepare.py --size 256 --workers 2, DirectRunner.
UNBOUNDED_BEFORE = {"sizes": {"5000": {"wall_s": 36, "peak_rss_mb": 1490}, "20000": {"peak_rss_mb": 1750},
                          "40000": {"wall_s": 158, "peak_rss_mb": 2000}},
                "slope_kb_per_input": 15.0, "extrapolated_imagenet_gb": 20.0}


def _bases(min_side: int = 720) -> list[Image.Image]:
    from common.photos import ALL, photo

    out = []
    for name in ALL:
        img = photo(name)
        scale = max(1.0, min_side / min(img.size))
        out.append(img.resize((round(img.width * scale), round(img.height * scale)), Image.Resampling.BICUBIC))
    return out


def write_crops(folder: Path, n: int, seed: int = 0) -> list[Path]:
    """``n`` distinct JPEG crops, 320-640 px a side, of the bundled photographs; one folder per photograph."""
    rng = np.random.default_rng(seed)
    bases = _bases()
    paths = []
    for i in range(n):
        b = i % len(bases)
        img = bases[b]
        w, h = (int(v) for v in rng.integers(320, 641, 2))
        w, h = min(w, img.width), min(h, img.height)
        x, y = int(rng.integers(0, img.width - w + 1)), int(rng.integers(0, img.height - h + 1))
        path = folder / f"photo{b:02d}" / f"{i:07d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        img.crop((x, y, x + w, y + h)).save(path, "JPEG", quality=90)
        paths.append(path)
    return paths


def link_subset(paths: list[Path], folder: Path) -> Path:
    for p in paths:
        (folder / p.parent.name).mkdir(parents=True, exist_ok=True)
        os.link(p, folder / p.parent.name / p.name)
    return folder


def make_corpora(root: Path, sizes: list[int]) -> dict[int, Path]:
    """One folder per size under ``root``: the largest written once, the others hard links to its first files."""
    all_dir = root / f"all-{max(sizes)}"
    if not all_dir.is_dir():
        part = root / f".partial-{os.getpid()}"
        write_crops(part, max(sizes))
        part.rename(all_dir)
    paths = sorted(all_dir.rglob("*.jpg"), key=lambda p: p.name)
    corpora = {}
    for n in sorted(sizes):
        folder = root / f"n{n}" if n != max(sizes) else all_dir
        if not folder.is_dir():
            link_subset(paths[:n], root / f".partial-{n}")
            (root / f".partial-{n}").rename(folder)
        corpora[n] = folder
    return corpora


def _role(proc: psutil.Process, root_pid: int) -> str:
    if proc.pid == root_pid:
        return "driver"
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "other"
    if "sdk_worker" in cmd or "worker_pool" in cmd:
        return "beam_worker"
    if "distributed" in cmd or "dask" in cmd or "multiprocessing" in cmd:
        return "dask"
    if cmd.startswith("ray::") or "/ray/" in cmd:  # Ray's workers and actors, and its own servers
        return "ray"
    return "other"


# What a resident set is made of (Linux, /proc/PID/status): anonymous pages are memory the
# process holds; file-backed pages (memory-mapped shards, libraries) are page cache the
# kernel can drop and read again; shared memory (Ray's object store, /dev/shm) is real memory
# that every process mapping it counts. "pss" (smaps_rollup) divides each shared page among
# the processes that map it, so the tree's sum counts it once.
KINDS = ("rss", "anon", "shmem", "file", "pss")


def _kb_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    out = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in names:
                out[name] = int(rest.split()[0]) << 10
    return out


def memory_by_kind(pid: int) -> dict[str, int]:
    """Bytes resident in process ``pid`` by kind (:data:`KINDS`); psutil's split where /proc lacks one."""
    try:
        st = _kb_fields(f"/proc/{pid}/status", ("VmRSS", "RssAnon", "RssFile", "RssShmem"))
        pss = _kb_fields(f"/proc/{pid}/smaps_rollup", ("Pss",))
        return {"rss": st["VmRSS"], "anon": st["RssAnon"], "shmem": st["RssShmem"], "file": st["RssFile"],
                "pss": pss["Pss"]}
    except (OSError, KeyError):
        m = psutil.Process(pid).memory_info()
        shared = getattr(m, "shared", 0)
        return {"rss": m.rss, "anon": m.rss - shared, "shmem": 0, "file": shared, "pss": m.rss}


class TreeSampler:
    """The peak resident set of a process and all its descendants, by kind of memory and of process.

    Each kind's peak is the largest sum over the tree at one sample; the kinds' peaks may
    come from different samples, so they need not add up to the resident set's.
    """

    def __init__(self, pid: int, every: float = 0.5):
        self.pid, self.every = pid, every
        self.peak_by_kind = dict.fromkeys(KINDS, 0)
        self.by_role: dict[str, dict[str, int]] = {}  # kind of process -> its peak of each kind of memory
        self.trace: list[tuple[float, dict]] = []  # (seconds, RSS MB by kind of process and the tree's MB by kind)
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def peak(self) -> int:
        return self.peak_by_kind["rss"]

    def _sample(self) -> None:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        total, roles = dict.fromkeys(KINDS, 0), {}
        for p in procs:
            try:
                mem = memory_by_kind(p.pid)
            except psutil.Error:
                continue
            role = roles.setdefault(_role(p, self.pid), dict.fromkeys(KINDS, 0))
            for kind, v in mem.items():
                total[kind] += v
                role[kind] += v
        for kind, v in total.items():
            self.peak_by_kind[kind] = max(self.peak_by_kind[kind], v)
        for name, mem in roles.items():
            peak = self.by_role.setdefault(name, dict.fromkeys(KINDS, 0))
            for kind, v in mem.items():
                peak[kind] = max(peak[kind], v)
        self.trace.append((round(time.perf_counter() - self._t0, 1),
                           {**{k: v["rss"] >> 20 for k, v in roles.items()},
                            "tree_mb": {k: v >> 20 for k, v in total.items()}}))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.every)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def job_env(repo: Path, home: Path) -> dict[str, str]:
    """The environment a measured job runs in: ``repo``'s code, a private VITSCALE_HOME, one BLAS thread."""
    env = dict(os.environ, VITSCALE_HOME=str(home), OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def run_sampled(cmd: list[str], env: dict[str, str], trace: Path | None = None) -> tuple[str, float, TreeSampler]:
    """Run ``cmd`` to its end while sampling its process tree: its stdout, the wall seconds and the sampler.

    A failed command ends the benchmark with its stderr's tail.
    """
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with TreeSampler(proc.pid) as sampler:
        out, err = proc.communicate()
    wall = time.perf_counter() - t
    if trace is not None:
        trace.write_text("".join(json.dumps({"t": t, **mb}) + "\n" for t, mb in sampler.trace))
    if proc.returncode:
        raise SystemExit(f"{Path(cmd[1]).name} failed ({proc.returncode}): {' '.join(cmd[2:])}\n{err[-3000:]}")
    return out, wall, sampler


def peaks(sampler: TreeSampler) -> dict:
    """The tree's peak of each kind of memory, and each kind of process's own peaks, in MB."""
    mb = {f"peak_{kind}_mb": round(v / 2**20) for kind, v in sampler.peak_by_kind.items()}
    return {**mb, "peak_rss_mb_by_process": {k: round(v["rss"] / 2**20) for k, v in sorted(sampler.by_role.items())},
            "peak_mb_by_process_and_kind": {k: {kind: round(b / 2**20) for kind, b in v.items() if kind != "rss"}
                                            for k, v in sorted(sampler.by_role.items())}}


def run_prepare(repo: Path, inputs: Path, output: Path, home: Path, runner: str, workers: int,
                size: int, trace: Path | None = None) -> dict:
    cmd = [sys.executable, str(repo / "jobs" / "prepare.py"), "--input", str(inputs), "--output", str(output),
           "--workers", str(workers), "--runner", runner, "--size", str(size)]
    _, wall, sampler = run_sampled(cmd, job_env(repo, home), trace)
    manifest = json.loads((output / "manifest.json").read_text())
    return {"wall_s": round(wall, 1), **peaks(sampler),
            "written": manifest["counts"]["written"], "shards": len(manifest["shards"]),
            "shard_sha256": [s["sha256"] for s in manifest["shards"]]}


def summarise(runs: dict[int, dict]) -> dict:
    """Rates between sizes, and the peak's growth per input between the two largest sizes.

    The slope is taken between the two largest sizes, not fitted through all of them: a
    corpus of fewer shards than workers has fewer shard writers running at once, each holding
    a batch of images, and a worker's first shard leaves it a little larger than it found it,
    so sizes below about two shards per worker (about 45k of these crops with 2
    workers) mix those fixed costs into the per-input one. The fit over every size is given too.
    """
    sizes = sorted(runs)
    peak = np.array([runs[s]["peak_rss_mb"] for s in sizes], float)
    marginal = {f"{a}-{b}": round((b - a) / max(runs[b]["wall_s"] - runs[a]["wall_s"], 1e-9), 1)
                for a, b in zip(sizes, sizes[1:])}
    rates = list(marginal.values())
    out = {
        "sizes": {str(s): {k: v for k, v in runs[s].items() if k != "shard_sha256"} for s in sizes},
        "marginal_img_s": marginal,
        "marginal_last_over_first": round(rates[-1] / rates[0], 2) if len(rates) > 1 else None,
    }
    if len(sizes) > 1:
        (a, b), (pa_, pb) = sizes[-2:], peak[-2:]
        slope = float(pb - pa_) / (b - a)  # MB per input
        fit = float(np.polyfit(np.array(sizes, float), peak, 1)[0])
        out.update({
            "slope_kb_per_input": round(slope * 1024, 2),
            "slope_kb_per_input_fit_all_sizes": round(fit * 1024, 2),
            "extrapolated_imagenet_gb": round((float(pb) + slope * (IMAGENET - b)) / 1024, 2),
            **{f"slope_{kind}_kb_per_input": round((runs[b][f"peak_{kind}_mb"] - runs[a][f"peak_{kind}_mb"])
                                                   * 1024 / (b - a), 2) for kind in KINDS if kind != "rss"},
        })
    return out


def table(rows: dict[str, dict], slopes: dict[str, dict] | None = None) -> str:
    """A text table of each row's wall time and peak MB by kind of memory, and the slopes in KB per input."""
    head = f"{'':<22}{'wall s':>8}" + "".join(f"{'peak ' + k + ' MB':>14}" for k in KINDS)
    lines = [head] + [f"{name:<22}{r['wall_s']:>8}" + "".join(f"{r[f'peak_{k}_mb']:>14,}" for k in KINDS)
                      for name, r in rows.items()]
    for name, by_kind in (slopes or {}).items():
        lines.append(f"{name + ' KB/input':<30}" + "".join(f"{by_kind[k]:>14}" for k in KINDS))
    return "\n".join(lines)


def measure(repo: Path, corpora: dict[int, Path], tmp: Path, runner: str, workers: int, size: int,
            tag: str, traces: Path | None = None) -> dict[int, dict]:
    runs = {}
    for n, folder in corpora.items():
        out = tmp / f"out-{tag}-{n}"
        trace = traces / f"{tag}-{runner}-{n}.jsonl" if traces else None
        runs[n] = run_prepare(repo, folder, out, tmp / "mlruns", runner, workers, size, trace)
        print(f"{tag} {runner} {n}: {json.dumps(runs[n])}", file=sys.stderr, flush=True)
        shutil.rmtree(out)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="20000,80000,160000", help="corpus sizes, comma-separated")
    ap.add_argument("--runner", choices=("direct", "dask"), default="direct")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--size", type=int, default=256, help="prepare --size")
    ap.add_argument("--baseline-repo", type=Path, default=None,
                    help="also run this checkout's prepare on the same corpora (the code before a change)")
    ap.add_argument("--traces", type=Path, default=None,
                    help="write each run's resident set over time (MB by kind of process, every 0.5 s) here")
    ap.add_argument("--keep", type=Path, default=None, help="generate the corpora here and keep them (reused)")
    args = ap.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    runner = "DirectRunner" if args.runner == "direct" else "dask"
    if args.traces:
        args.traces.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="vitscale-ingest-scale-") as tmp:
        tmp = Path(tmp)
        t = time.perf_counter()
        corpora = make_corpora(args.keep or tmp / "corpus", sizes)
        gen_s = time.perf_counter() - t
        print(f"corpora ready in {gen_s:.0f} s", file=sys.stderr, flush=True)

        ours = measure(REPO, corpora, tmp, runner, args.workers, args.size, "this", args.traces)
        result = {
            "benchmark": "ingest_scale",
            "figure": "slope_kb_per_input",
            "runner": args.runner,
            "workers": args.workers,
            "size": args.size,
            **summarise(ours),
        }
        if args.baseline_repo:
            before = measure(args.baseline_repo.resolve(), corpora, tmp, runner, args.workers, args.size, "baseline",
                             args.traces)
            result["baseline"] = {"repo": str(args.baseline_repo), **summarise(before)}
            result["same_shards_as_baseline"] = all(ours[n]["shard_sha256"] == before[n]["shard_sha256"]
                                                   for n in sizes)
        else:
            result["baseline"] = {"source": "measured before the ingest's memory was bounded", **UNBOUNDED_BEFORE}
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    result["machine"] = machine.describe()
    if len(sizes) > 1:
        slopes = {"slope": {k: result["slope_kb_per_input" if k == "rss" else f"slope_{k}_kb_per_input"] for k in KINDS}}
        print(table({str(n): r for n, r in result["sizes"].items()}, slopes), file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
