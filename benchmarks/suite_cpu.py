"""What the test suite costs in CPU, and the shortest it could run on this machine's cores.

Reads the log a suite run writes with ``SUITE_CPU_LOG=FILE`` (``tests/conftest.py``): per test,
its wall time and the CPU seconds the whole machine spent busy meanwhile (every process: pytest,
Ray's workers, the jobs and servers tests start), and the machine's busy CPU at the session's start
and end. On a machine running nothing else, the busy CPU is the suite's own.

- ``floor_s``: the suite's busy CPU over the cores, the wall time it would take with every core busy
  throughout: no parallel runner (pytest-xdist, more Ray workers) can finish it sooner;
- per test file, its CPU and wall time, the largest first;
- with ``--ray-tmp DIR`` (the ``RAY_TMPDIR`` the run used): the Ray Train fits and the Tune trial
  processes the suite started, counted from the Ray sessions' worker logs, and with
  ``--fit-cpu-s`` (a fit's CPU from ``benchmarks/fit_startup.py``) what its fits cost together.

The anchor is the same run's wall time. The last line printed is one JSON object.

    SUITE_CPU_LOG=/tmp/suite_cpu.jsonl RAY_TMPDIR=/tmp/suite_ray make test
    python benchmarks/suite_cpu.py /tmp/suite_cpu.jsonl [--ray-tmp /tmp/suite_ray] [--fit-cpu-s 40] [--top 15]
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.fit_startup import actors_started  # noqa: E402

TARGET_S = 25 * 60
# The actors of one Tune trial's process: the function trainable (reused from trial to trial in a
# sweep), or a trial named for its sweep when Tune's own actor is not reused.
TRIAL_ACTORS = ("ImplicitFunc",)


def read_log(path: Path) -> tuple[dict, dict, list[dict]]:
    """The newest run in the log (a file written by several runs), its end and its tests. A
    pytest run inside a test writes nothing (``tests/conftest.py``): its CPU is the test's."""
    hint = f"write it with SUITE_CPU_LOG={path} make test, and let the run end"
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise SystemExit(f"suite_cpu: error: {path}: cannot be read ({exc.strerror}); {hint}") from None
    start = finish = None
    tests = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # the line a killed run was writing
            continue
        if "start" in record:
            start, finish, tests = record, None, []
        elif "finish" in record:
            finish = record
        else:
            tests.append(record)
    if start is None or finish is None:
        raise SystemExit(f"suite_cpu: error: {path}: its newest run has no start or no end; {hint}")
    return start, finish, tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--ray-tmp", type=Path, help="the RAY_TMPDIR of the run, to count its fits and trials")
    parser.add_argument("--fit-cpu-s", type=float, help="a fit's CPU seconds (benchmarks/fit_startup.py)")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    start, finish, tests = read_log(args.log)
    cores = finish["machine"]["cores"]
    wall = finish["finish"] - start["start"]
    busy = finish["busy_cpu_s"] - start["busy_cpu_s"]
    files = collections.defaultdict(lambda: {"tests": 0, "wall_s": 0.0, "cpu_s": 0.0})
    for t in tests:
        f = files[t["test"].split("::")[0]]
        f["tests"] += 1
        f["wall_s"] += t["wall_s"]
        f["cpu_s"] += t["cpu_s"]
    largest = sorted(files.items(), key=lambda kv: -kv[1]["cpu_s"])[:args.top]
    print(f"{'cpu s':>8} {'wall s':>8} {'tests':>5}  file")
    for name, f in largest:
        print(f"{f['cpu_s']:8.0f} {f['wall_s']:8.0f} {f['tests']:5d}  {name}")
    report = {"benchmark": "suite_cpu", "tests": len(tests), "exitstatus": finish["exitstatus"],
              "wall_s": round(wall, 1), "busy_cpu_s": round(busy, 1), "cores": cores,
              "utilisation": round(busy / (wall * cores), 3), "floor_s": round(busy / cores, 1),
              "target_s": TARGET_S, "floor_over_target": round(busy / cores / TARGET_S, 2),
              "largest_files": [{"file": n, **{k: round(v, 1) for k, v in f.items()}} for n, f in largest]}
    if args.ray_tmp:
        actors = collections.Counter()
        for session in args.ray_tmp.glob("ray/session_2*"):
            actors += actors_started(session)
        report["fits"] = actors["TrainController"]
        report["trial_processes"] = sum(actors[a] for a in TRIAL_ACTORS)
        if args.fit_cpu_s:
            report["fits_cpu_s"] = round(report["fits"] * args.fit_cpu_s, 1)
            report["fits_floor_s"] = round(report["fits"] * args.fit_cpu_s / cores, 1)
    report["machine"] = finish["machine"]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
