"""Start a Dask cluster whose workers are batch jobs, for ``prepare --runner dask`` (see README.md).

    python infra/dask/jobqueue_cluster.py --scheduler slurm --jobs 16 --queue cpu \
        --address-file /shared/vitscale/scheduler-address

Runs on a login node until interrupted. The scheduler listens on the address the batch nodes
reach it by (``--interface``, e.g. ib0); each batch job runs one single-threaded worker from
this project's environment, so the workers import the same code as the job. Needs
``dask-jobqueue`` (not a project dependency: install it beside the ``dask`` extra).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheduler", choices=["slurm", "pbs", "lsf", "sge"], default="slurm")
    ap.add_argument("--jobs", type=int, default=4, help="batch jobs, one worker each")
    ap.add_argument("--queue", default=None)
    ap.add_argument("--account", default=None)
    ap.add_argument("--memory", default="4GB", help="per worker")
    ap.add_argument("--walltime", default="04:00:00")
    ap.add_argument("--interface", default=None, help="network interface the batch nodes reach this node on")
    ap.add_argument("--address-file", required=True, help="file on the shared filesystem to write the address to")
    args = ap.parse_args()

    import dask_jobqueue

    cls = {"slurm": dask_jobqueue.SLURMCluster, "pbs": dask_jobqueue.PBSCluster,
           "lsf": dask_jobqueue.LSFCluster, "sge": dask_jobqueue.SGECluster}[args.scheduler]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cluster = cls(
        cores=1, processes=1, memory=args.memory, walltime=args.walltime, queue=args.queue, account=args.account,
        interface=args.interface, python=sys.executable,
        # The workers import pipelines/ from this checkout, like the job that submits to them.
        job_script_prologue=[f"export PYTHONPATH={repo}", "export OMP_NUM_THREADS=1"],
        scheduler_options={"dashboard_address": None},
    )
    cluster.scale(jobs=args.jobs)
    with open(args.address_file, "w") as f:
        f.write(cluster.scheduler_address + "\n")
    print(f"scheduler at {cluster.scheduler_address}; {args.jobs} worker job(s) submitted; Ctrl-C stops them",
          flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(60)
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
