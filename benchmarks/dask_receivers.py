"""A Dask worker's peak memory when a step's outputs wait for a combine.

64 partitions, each emitting ``PER`` values of 100 KB into ``Map(len)`` and a
``CombineGlobally(sum)``, on a local cluster of one worker process with this project's
DaskRunner; the worker's RssAnon is sampled every 0.2 s. With Beam's receivers kept in the
task's arguments (before ``pipelines.dask_runner._apply_dofn``) the peak follows the outputs.

    PYTHONPATH=$PWD python benchmarks/dask_receivers.py PER

Prints one JSON line.
"""
import json
import sys
import threading

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from distributed import Client, LocalCluster


def anon(dask_worker=None):
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) >> 10


def big(i, per):
    return [bytes([i % 256]) * 100_000 + bytes(str(j), "ascii") for j in range(per)]


if __name__ == "__main__":
    per = int(sys.argv[1])
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None)
    c = Client(cluster)
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], max(c.run(anon).values()))
            except Exception:  # noqa: BLE001 - a busy worker misses one sample
                pass
            stop.wait(0.2)

    base = max(c.run(anon).values())
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    opts = PipelineOptions(["--runner=pipelines.dask_runner.DaskRunner",
                            f"--dask_client_address={cluster.scheduler_address}", "--dask_npartitions=64"])
    with beam.Pipeline(options=opts) as p:
        _ = (p | beam.Create(list(range(64))) | "Big" >> beam.FlatMap(big, per) | beam.Map(len)
             | beam.CombineGlobally(sum))
    stop.set()
    t.join()
    print(json.dumps({"per": per, "outputs_mb": 64 * per * 100_000 >> 20, "base_anon_mb": base, "peak_anon_mb": peak[0]}))
    c.close()
    cluster.close()
