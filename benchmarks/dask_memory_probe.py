"""Where ``prepare --runner dask`` holds its memory: each process of the cluster apart.

``ingest_scale.py`` starts a ``LocalCluster`` inside the driver, so its scheduler and nannies
count as the driver and both workers as one "dask" figure. This probe starts the cluster as
separate processes instead (``dask scheduler`` and two ``dask worker --nthreads 1 --no-nanny``,
as ``tests/pipelines/test_dask.py`` does), runs ``jobs/prepare.py --dask-address`` on it, and
samples every 0.25 s the VmRSS and RssAnon of the driver, the scheduler and each worker. Every
0.5 s it also asks each worker (``client.run``) what Dask holds there (the count and Dask's
``sizeof`` of the task results it keeps), its RssAnon and which task it is running, and the
scheduler how many tasks it holds. After the job, each worker's RssAnon before and after
``gc.collect()`` and ``malloc_trim(0)``. ``TM=1`` runs tracemalloc in the workers (slow) and
reports the traced Python memory, and its growth by source line since the workers' 10th sample
with a task running.

    REPO=$PWD python benchmarks/dask_memory_probe.py CORPUS OUT TAG [prepare flags...]

Prints one JSON line; writes the per-worker trace to ``$PROBE_DIR/TAG.wtrace.json`` (default /tmp).
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(os.environ["REPO"])
DASK = str(Path(sys.executable).parent / "dask")
WORK = Path(os.environ.get("PROBE_DIR", "/tmp"))
corpus, out, tag = sys.argv[1], sys.argv[2], sys.argv[3]
extra = sys.argv[4:]
s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()
addr = f"tcp://127.0.0.1:{port}"
env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", VITSCALE_HOME=str(WORK / f"home-{tag}"))
env.pop("MLFLOW_TRACKING_URI", None)
logs = open(WORK / f"{tag}.cluster.log", "wb")
http = ["--no-dashboard", "--dashboard-address", "127.0.0.1:0"]
procs = {"scheduler": subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port), *http],
                                       env=env, stdout=logs, stderr=logs)}
for i in range(2):
    procs[f"w{i}"] = subprocess.Popen(
        [DASK, "worker", addr, "--host", "127.0.0.1", "--nthreads", "1", "--no-nanny", *http, "--name", f"w{i}",
         "--local-directory", str(WORK / f"wdir-{tag}-{i}")], env=env, stdout=logs, stderr=logs)
from distributed import Client  # noqa: E402

c = Client(addr, timeout=60, set_as_default=False)
c.wait_for_workers(2, timeout=120)
peak = {}
held = {"w_items": 0, "w_bytes": 0, "sched_tasks": 0}


def mem(pid):
    d = {}
    for line in open(f"/proc/{pid}/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon"):
            d[k] = int(v.split()[0]) >> 10
    return d


stop = threading.Event()
TRACE = []
t0 = time.time()


def sample():
    while not stop.is_set():
        for name, p in list(procs.items()):
            try:
                for k, v in mem(p.pid).items():
                    peak[(name, k)] = max(peak.get((name, k), 0), v)
            except OSError:
                pass
        stop.wait(0.25)


def info(dask_worker):
    import builtins
    import tracemalloc

    anon = 0
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            anon = int(line.split()[1]) >> 10
    ex = [str(ts.key[0] if isinstance(ts.key, tuple) else ts.key)[:70] for ts in dask_worker.state.executing]
    cur = tracemalloc.get_traced_memory()[0] >> 20 if tracemalloc.is_tracing() else -1
    if ex and tracemalloc.is_tracing() and not hasattr(builtins, "_snap0"):
        builtins._snap0_n = getattr(builtins, "_snap0_n", 0) + 1
        if builtins._snap0_n == 10:
            builtins._snap0 = tracemalloc.take_snapshot()
    return (len(dask_worker.data), dask_worker.state.nbytes, anon, ex, cur)


def held_sampler():
    while not stop.is_set():
        try:
            r = c.run(info)
            TRACE.append((round(time.time() - t0, 1), {w: v[2:] for w, v in r.items()}))
            held["w_items"] = max(held["w_items"], sum(v[0] for v in r.values()))
            held["w_bytes"] = max(held["w_bytes"], sum(v[1] for v in r.values()))
            held["sched_tasks"] = max(held["sched_tasks"],
                                      c.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)))
        except Exception:  # noqa: BLE001 - a worker busy or gone misses one sample
            pass
        stop.wait(0.5)


def after():
    import builtins
    import ctypes
    import gc
    import tracemalloc

    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon"):
                return int(line.split()[1]) >> 10

    res = {"anon_end": anon()}
    if tracemalloc.is_tracing():
        cur, pk = tracemalloc.get_traced_memory()
        res["traced_cur_mb"], res["traced_peak_mb"] = cur >> 20, pk >> 20
        snap = tracemalloc.take_snapshot()
        res["diff"] = ([str(st) for st in snap.compare_to(builtins._snap0, "lineno")[:12]]
                       if hasattr(builtins, "_snap0") else None)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    res["anon_after_trim"] = anon()
    return res


if os.environ.get("TM"):
    c.run(lambda: __import__("tracemalloc").start(int(os.environ["TM"])))
threads = [threading.Thread(target=sample, daemon=True), threading.Thread(target=held_sampler, daemon=True)]
for t in threads:
    t.start()
t0 = time.time()
job = subprocess.Popen([sys.executable, str(REPO / "jobs/prepare.py"), "--input", corpus, "--output", out,
                        "--workers", "2", "--runner", "dask", "--dask-address", addr, "--size", "256",
                        "--overwrite", *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
procs["driver"] = job
_, err = job.communicate()
wall = time.time() - t0
stop.set()
for t in threads:
    t.join()
res_after = c.run(after)
c.close()
for p in procs.values():
    if p.poll() is None:
        p.kill()  # a --no-nanny worker outlives SIGTERM, retrying its lost scheduler
res = {"tag": tag, "rc": job.returncode, "wall_s": round(wall, 1),
       "peak_mb": {f"{a}.{b}": v for (a, b), v in sorted(peak.items())}, "after": res_after,
       "held": {**held, "w_bytes_mb": held["w_bytes"] >> 20}}
if job.returncode:
    res["err"] = err[-2000:]
print(json.dumps(res))
(WORK / f"{tag}.wtrace.json").write_text(json.dumps(TRACE))
