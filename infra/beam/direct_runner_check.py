"""Does this Beam's DirectRunner drop elements with several workers? Run a minimal pipeline and count.

Beam 2.77's DirectRunner, with ``direct_num_workers > 1``, now and then loses elements between
the runner and its workers, without any error. The cause is a race in Beam's time-based flushing
of its data streams (``pipelines/direct_runner.py`` explains it); ``jobs/prepare.py`` turns that
flushing off, and its accounting check re-runs in one process should anything still go missing
(docs/ingest.md, "Every input is accounted for"). This script measures whether the Beam installed
here still has the race (Beam's defaults), and whether the prepare's setting avoids it
(``--as-prepare``). Run both after upgrading Beam.

The pipeline is the smallest one found that shows it: ``Create(units) -> FlatMap`` (16 elements
of ``--payload-kb`` random bytes per unit) ``-> GroupByKey`` on one key ``-> count``. The loss
needs large values crossing to the runner: with the same pipeline on small values, or with a
combiner instead of the GroupByKey, no run lost anything. In ``multi_threading`` mode on a
2-core machine it showed in 1 to 4 runs out of 8 (1 to 13 elements each); ``multi_processing``
loses more rarely, about one run in twenty of the real ingest; ``in_memory`` never did.

    python infra/beam/direct_runner_check.py [--runs 8] [--mode multi_threading] [--units 313] [--as-prepare]

The last line printed is one JSON object: the runs, and the elements each run lost.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

PER_UNIT = 16


def _one_run(units: int, payload: int, mode: str, out: str, as_prepare: bool) -> None:
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    def read_unit(u):
        for i in range(PER_UNIT):
            yield 0, (u * PER_UNIT + i, os.urandom(payload))

    def write(counts):
        with open(out, "w") as f:
            f.write(str(sum(counts)))

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from pipelines import direct_runner

    direct_runner.bind_servers_to_loopback()  # the runner's servers on loopback, as in the ingest
    if as_prepare:
        direct_runner.flush_by_size_only()
    workers = 1 if mode == "in_memory" else 2
    opts = PipelineOptions(["--runner=DirectRunner", f"--direct_num_workers={workers}",
                            f"--direct_running_mode={mode}"])
    with beam.Pipeline(options=opts) as p:
        (p
         | "Units" >> beam.Create(list(range(units)))
         | "Read" >> beam.FlatMap(read_unit)
         | "Group" >> beam.GroupByKey()
         | "Count" >> beam.Map(lambda kv: sum(1 for _ in kv[1]))
         | "All" >> beam.combiners.ToList()
         | "Write" >> beam.Map(write))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--mode", default="multi_threading", choices=["multi_threading", "multi_processing", "in_memory"])
    ap.add_argument("--units", type=int, default=313, help=f"input units of {PER_UNIT} elements each")
    ap.add_argument("--payload-kb", type=int, default=40, help="bytes per element, like an encoded 384 px image")
    ap.add_argument("--as-prepare", action="store_true",
                    help="with the data-stream setting jobs/prepare.py uses (pipelines/direct_runner.py)")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:  # one pipeline per process, so no run inherits another's threads or servers
        _one_run(args.units, args.payload_kb * 1000, args.mode, args._child, args.as_prepare)
        return

    import apache_beam

    expected = args.units * PER_UNIT
    lost = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            out = os.path.join(tmp, f"run{i}.txt")
            subprocess.run([sys.executable, __file__, "--mode", args.mode, "--units", str(args.units),
                            "--payload-kb", str(args.payload_kb), "--_child", out]
                           + (["--as-prepare"] if args.as_prepare else []),
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(out) as f:
                lost.append(expected - int(f.read()))
            print(f"run {i + 1}: {expected - lost[-1]} of {expected} elements arrived", flush=True)
    print(json.dumps({
        "check": "direct_runner_element_loss", "beam": apache_beam.__version__, "mode": args.mode,
        "as_prepare": args.as_prepare,
        "runs": args.runs, "elements_per_run": expected, "lost_per_run": lost,
        "runs_with_loss": sum(1 for n in lost if n), "in_memory_is_the_baseline": args.mode == "in_memory",
    }))


if __name__ == "__main__":
    main()
