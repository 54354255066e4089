"""What a pinned glibc mmap threshold costs CPU training in the same process.

The multi-worker DirectRunner's driver pins the threshold at 128 KiB for the length of the
pipeline (:func:`pipelines.glibc.mmap_threshold_pinned`) and sets glibc's 32 MiB ceiling
after it. This measures why it does not leave it pinned: a process that runs an ingest and then
trains (the demo, a test session) keeps the setting. Each mode runs in a fresh process: an MLP
block of ViT-B's width (768-3072-768) takes AdamW steps on 256 rows, 2 threads, ``--steps``
timed after 5 warm-up steps.

- ``default``: glibc's dynamic threshold (the baseline);
- ``pinned``: 128 KiB for the rest of the process;
- ``ceiling``: pinned, then set to 32 MiB, as after an ingest.

    python benchmarks/mmap_threshold.py [--repeats 3] [--steps 40]

The last line printed is one JSON object: milliseconds per step, the median of the repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import machine  # noqa: E402

_STEP = """
import sys, time, torch
from pipelines.glibc import THRESHOLD_CEILING, pin_mmap_threshold
mode, steps = sys.argv[1], int(sys.argv[2])
if mode in ("pinned", "ceiling"):
    assert pin_mmap_threshold(), "no glibc mallopt here"
if mode == "ceiling":
    pin_mmap_threshold(THRESHOLD_CEILING)
torch.set_num_threads(2)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(768, 3072), torch.nn.GELU(), torch.nn.Linear(3072, 768))
opt = torch.optim.AdamW(m.parameters())
x = torch.randn(256, 768)
def step():
    opt.zero_grad()
    m(x).pow(2).mean().backward()
    opt.step()
for _ in range(5):
    step()
t = time.perf_counter()
for _ in range(steps):
    step()
print((time.perf_counter() - t) / steps * 1000)
"""
MODES = ("default", "pinned", "ceiling")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:  # interleaved, so that a change in load touches every mode alike
            out = subprocess.run([sys.executable, "-c", _STEP, mode, str(args.steps)], capture_output=True,
                                 text=True, check=True, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2",
                                                             "PATH": "/usr/bin:/bin"})
            runs[mode].append(float(out.stdout))
    ms = {m: round(statistics.median(v), 2) for m, v in runs.items()}
    print(json.dumps({
        "benchmark": "mmap_threshold", "figure": "ms_per_step",
        "ms_per_step": ms, "runs_ms": {m: [round(x, 2) for x in v] for m, v in runs.items()},
        "baseline": "default", "pinned_over_default": round(ms["pinned"] / ms["default"], 3),
        "ceiling_over_default": round(ms["ceiling"] / ms["default"], 3),
        "machine": machine.describe(),
    }))


if __name__ == "__main__":
    main()
