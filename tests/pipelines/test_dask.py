"""The ingest on a real Dask cluster: a ``dask scheduler`` and two ``dask worker`` processes on loopback.

The cluster is started once for the module with the CLIs the ``dask[distributed]`` package
installs, each worker a separate process with no nanny, so that a test can kill one by its pid.
The workers import this checkout's code through ``PYTHONPATH``, as a real deployment imports
the installed project. The worker-kill test runs last: after it one worker is left.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("distributed")

import apache_beam as beam  # noqa: E402
from apache_beam.options.pipeline_options import PipelineOptions  # noqa: E402

from pipelines.schema import ShardSet  # noqa: E402
from tests.pipelines.imagefiles import encode, write

REPO = Path(__file__).resolve().parents[2]
DASK = str(Path(sys.executable).parent / "dask")
JOB = str(REPO / "jobs" / "prepare.py")


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _wait_for_workers(address: str, n: int, timeout: float = 120) -> None:
    from distributed import Client

    with Client(address, timeout=timeout, set_as_default=False) as client:
        client.wait_for_workers(n, timeout=timeout)


class Cluster:
    def __init__(self, tmp: Path, free_port):
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.logs = tmp
        # --host alone leaves each process's HTTP server (health, metrics) on every interface.
        http = ["--no-dashboard", "--dashboard-address", "127.0.0.1:0"]
        self.scheduler = self._start("scheduler", ["scheduler", "--host", "127.0.0.1", "--port", str(self.port), *http])
        self.workers = [
            self._start(f"worker{i}", ["worker", self.address, "--host", "127.0.0.1", "--nthreads", "1",
                                       "--no-nanny", *http, "--name", f"w{i}", "--local-directory", str(tmp / f"w{i}")])
            for i in range(2)
        ]
        _wait_for_workers(self.address, 2)

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        return subprocess.Popen([DASK, *args], stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO,
                                start_new_session=True)

    def alive_workers(self) -> list[subprocess.Popen]:
        return [w for w in self.workers if w.poll() is None]

    def stop(self, stop_process_group) -> None:
        for proc in [*self.workers, self.scheduler]:
            if proc.poll() is None:
                stop_process_group(proc)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, free_port, stop_process_group):
    c = Cluster(tmp_path_factory.mktemp("dask"), free_port)
    yield c
    c.stop(stop_process_group)


def _dask_options(address: str, runner: str = "pipelines.dask_runner.DaskRunner") -> PipelineOptions:
    return PipelineOptions([f"--runner={runner}", f"--dask_client_address={address}"])


# -- what Beam 2.77's DaskRunner gets wrong (pipelines/dask_runner.py) ----------------------------

class _Tagged(beam.DoFn):
    def process(self, x):
        if x % 2:
            yield beam.pvalue.TaggedOutput("odd", x)
        else:
            yield x


def _dump(rows, path):
    with open(path, "w") as f:
        json.dump(sorted(rows), f)


def test_beams_dask_runner_sends_main_output_to_tagged_outputs(cluster, tmp_path):
    """Why the ingest has no tagged outputs. If this fails after a Beam upgrade, the bug may be fixed."""
    with beam.Pipeline(options=_dask_options(cluster.address)) as p:
        out = p | beam.Create(range(6)) | beam.ParDo(_Tagged()).with_outputs("odd", main="even")
        _ = out.odd | "ListOdd" >> beam.combiners.ToList() | "DumpOdd" >> beam.Map(_dump, str(tmp_path / "odd"))
    odd = json.loads((tmp_path / "odd").read_text())
    assert odd == [0, 1, 2, 3, 4, 5]  # the even (main) elements came out of the "odd" output too


def test_a_pipeline_that_cannot_be_translated_leaves_no_client_open(cluster):
    import distributed

    with pytest.raises(IndexError):  # no step: no sink bag to compute
        beam.Pipeline(options=_dask_options(cluster.address)).run()
    with pytest.raises(ValueError, match="No clients found"):
        distributed.Client.current()


def _touch(x, log):
    with open(log, "a") as f:
        f.write(f"{x}\n")
    return x


def _side_input_pipeline(p, log, out):
    xs = p | beam.Create(list(range(20))) | "Touch" >> beam.Map(_touch, log)
    total = xs | beam.CombineGlobally(sum)
    (xs | "Add" >> beam.Map(lambda x, n: x + n, beam.pvalue.AsSingleton(total))
        | beam.combiners.ToList() | beam.Map(_dump, out))


def test_beams_dask_runner_computes_a_side_input_again_and_ours_once(cluster, tmp_path):
    """Why pipelines.dask_runner.DaskRunner exists. If the first half fails after a Beam upgrade, it may be fixed."""
    log, out = tmp_path / "touched", tmp_path / "out"
    p = beam.Pipeline(options=_dask_options(cluster.address, "apache_beam.runners.dask.dask_runner.DaskRunner"))
    _side_input_pipeline(p, str(log), str(out))
    result = p.run()
    try:
        result.wait_until_finish()
    finally:
        result.client.close()  # the stock runner leaves its client open
    assert len(log.read_text().splitlines()) > 20  # the producer of the side input ran again
    assert json.loads(out.read_text()) != [x + 190 for x in range(20)]  # and the sum it saw was not 190

    log.unlink()
    with beam.Pipeline(options=_dask_options(cluster.address)) as p:
        _side_input_pipeline(p, str(log), str(out))
    assert len(log.read_text().splitlines()) == 20
    assert json.loads(out.read_text()) == [x + 190 for x in range(20)]


def _receivers_in(graph) -> list:
    """Every Beam output receiver among the graph's task arguments."""
    from apache_beam.runners.dask.transform_evaluator import OneReceiver

    found, todo = [], list(graph.values())
    while todo:
        x = todo.pop()
        if isinstance(x, OneReceiver):
            found.append(x)
        elif isinstance(x, (tuple, list)):
            todo.extend(x)
        elif hasattr(x, "args") and hasattr(x, "kwargs"):  # a dask Task
            todo.extend([*x.args, *x.kwargs.values()])
        elif type(x).__name__ == "DataNode":
            todo.append(x.value)
    return found


def test_a_finished_bundle_keeps_none_of_its_outputs():
    """A Dask worker keeps a task's arguments until its result is released, and Beam's receivers are one.

    Stock Beam leaves every output of a bundle in them, so a step before a shuffle held all it
    emitted (decoded images) until the shuffle had every partition: the workers' growth on Dask.
    (Where the tasks share one copy of the arguments, as in Dask's in-process scheduler here,
    stock Beam even emitted earlier bundles' outputs again: 60 elements instead of 24.)
    """
    import dask
    from apache_beam.runners.dask.overrides import dask_overrides

    from pipelines.dask_runner import _bag_visitor

    p = beam.Pipeline()
    _ = p | beam.Create(list(range(8))) | "Big" >> beam.FlatMap(lambda i: [bytes(1000)] * 3)
    p.replace_all(dask_overrides())
    visitor = _bag_visitor({"npartitions": 4})
    p.visit(visitor)
    bag = list(visitor.bags.values())[-1]
    graph = dict(bag.__dask_graph__())
    receivers = _receivers_in(graph)
    assert receivers, "no Beam receivers found in the graph; the test no longer sees them"
    (out,) = dask.compute(bag, scheduler="sync", optimize_graph=False)
    assert len(out) == 24
    assert all(r.values == [] for r in receivers)


class _CountBundle(beam.DoFn):
    """Emits one element per bundle, from finish_bundle: how many elements the bundle had."""

    def start_bundle(self):
        self.n = 0

    def process(self, x):
        self.n += 1

    def finish_bundle(self):
        from apache_beam.transforms.window import GlobalWindow
        from apache_beam.utils.windowed_value import WindowedValue

        yield WindowedValue(self.n, GlobalWindow().max_timestamp(), (GlobalWindow(),))


def _bundle_counts(p, out):
    (p | beam.Create(list(range(300))) | beam.ParDo(_CountBundle())
     | beam.combiners.ToList() | beam.Map(_dump, out))


def test_beams_dask_runner_drops_what_finish_bundle_emits_and_ours_keeps_it(cluster, tmp_path):
    """Beam 2.77 takes a bundle's outputs before finish_bundle; the lifted combines emit from there."""
    out = tmp_path / "out"
    p = beam.Pipeline(options=_dask_options(cluster.address, "apache_beam.runners.dask.dask_runner.DaskRunner"))
    _bundle_counts(p, str(out))
    result = p.run()
    try:
        result.wait_until_finish()
    finally:
        result.client.close()
    assert json.loads(out.read_text()) == []  # every bundle's count was lost

    with beam.Pipeline(options=_dask_options(cluster.address)) as p:
        _bundle_counts(p, str(out))
    counts = json.loads(out.read_text())
    assert sum(counts) == 300 and len(counts) > 1


class _Partials(beam.CombineFn):
    """Sums, and counts how many partial accumulators the final merge received."""

    def create_accumulator(self):
        return 0, 0

    def add_input(self, acc, x):
        return acc[0] + x, 1

    def merge_accumulators(self, accs):
        accs = list(accs)
        return sum(a[0] for a in accs), sum(a[1] for a in accs)

    def extract_output(self, acc):
        return {"sum": acc[0], "partials": acc[1]}


def test_combines_are_lifted_one_accumulator_per_bundle_crosses_the_shuffle(cluster, tmp_path):
    """Stock Beam on Dask sends every element of a combine through a task shuffle, whose
    pieces the workers keep until all are split; the ingest counts every input four times that way."""
    out = tmp_path / "out"
    n = 1000
    with beam.Pipeline(options=_dask_options(cluster.address)) as p:
        xs = p | beam.Create(list(range(n)))
        rows = (
            xs | "Partials" >> beam.CombineGlobally(_Partials()),
            xs | "Keyed" >> beam.Map(lambda x: (x % 3, x)) | beam.CombinePerKey(sum) | "KeyedRow" >> beam.Map(list),
            xs | "Mod7" >> beam.Map(lambda x: x % 7) | beam.Distinct() | beam.combiners.ToList()
            | "SortDistinct" >> beam.Map(sorted),
            xs | "Count" >> beam.combiners.Count.Globally() | "CountRow" >> beam.Map(lambda c: {"count": c}),
            xs | "Mean" >> beam.combiners.Mean.Globally() | "MeanRow" >> beam.Map(lambda m: {"mean": m}),
            p | "Nothing" >> beam.Create([]) | "EmptySum" >> beam.CombineGlobally(sum)
            | "Empty" >> beam.Map(lambda s: {"empty_sum": s}),
        )
        _ = rows | beam.Flatten() | "All" >> beam.combiners.ToList() | beam.Map(
            lambda r, path: open(path, "w").write(json.dumps(r)), str(out))
    got = json.loads(out.read_text())
    partials = next(r for r in got if isinstance(r, dict) and "partials" in r)
    assert partials["sum"] == sum(range(n))
    # One partial accumulator per bundle (Beam's Dask Create makes bundles of 128), not one per element.
    assert 1 < partials["partials"] <= 16
    assert sorted(r for r in got if isinstance(r, list) and len(r) == 2) == [
        [k, sum(x for x in range(n) if x % 3 == k)] for k in range(3)]
    assert [0, 1, 2, 3, 4, 5, 6] in got
    assert {"count": n} in got and {"mean": (n - 1) / 2} in got and {"empty_sum": 0} in got


_FRAGMENTED_HEAP = """
import ctypes, json, sys
from pipelines.dask_runner import give_back_freed_memory

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)

def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) >> 10

base = anon()
big, small = [], []
for _ in range(2000):  # 100 KB blocks (under the mmap threshold: from the heap), each pinned by a small one after it
    b = libc.malloc(100_000)
    ctypes.memset(b, 1, 100_000)
    big.append(b)
    small.append(libc.malloc(64))
for b in big:
    libc.free(b)
kept = anon()
ran = give_back_freed_memory(0)
print(json.dumps({"grown": kept - base, "after": anon() - base, "ran": ran, "again": give_back_freed_memory(3600)}))
"""


def test_a_worker_gives_freed_heap_pages_back(tmp_path):
    """What a Dask worker calls after each bundle: free chunks glibc cannot trim off its heap's top go back."""
    env = dict(_env())
    env.pop("MALLOC_TRIM_THRESHOLD_", None)  # a LocalCluster elsewhere in the session may have set it
    out = subprocess.run([sys.executable, "-c", _FRAGMENTED_HEAP], env=env, capture_output=True, text=True,
                         check=True, cwd=REPO)
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["ran"] and not got["again"]  # at most once per interval
    assert got["grown"] > 100, got  # MB: freed, but kept by the heap
    assert got["after"] < 30, got


# -- the ingest on Dask against the DirectRunner -----------------------------------------------





BAD = {
    "bad/empty.jpg": "empty_file",
    "bad/truncated.jpg": "truncated",
    "bad/notes.txt": "not_an_image",
    "bad/tiny.png": "too_small",
    "bad/wide.png": "unexpected_error",  # JPEG cannot store 66000 px: an encoder exception, dead-lettered
    "broken.tar": "corrupt_archive",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, photos, noisy_copies):
    """A dozen distinct photos in two classes, every kind of bad input, a corpus and a test-set duplicate."""
    import io
    import tarfile

    from PIL import Image

    root = tmp_path_factory.mktemp("dask_corpus")
    noisy_copies(root / "src", photos, 12, classes=2, class_prefix="class", spread=20, seed=3, size=(80, 64))
    src = root / "src"
    write(src / "class0" / "chelsea.png", encode(photos["chelsea"], "PNG"))
    write(src / "class1" / "chelsea_again.bmp", encode(photos["chelsea"], "BMP"))  # a corpus duplicate
    write(src / "class1" / "astronaut_copy.png", encode(photos["astronaut"], "PNG"))  # in the test set
    write(root / "test" / "t" / "astronaut.png", encode(photos["astronaut"], "PNG"))
    jpg = encode(photos["coffee"], "JPEG")
    write(src / "bad" / "empty.jpg", b"")
    write(src / "bad" / "truncated.jpg", jpg[: len(jpg) // 2])
    write(src / "bad" / "notes.txt", b"not an image\n")
    write(src / "bad" / "tiny.png", encode(photos["coffee"].resize((12, 10)), "PNG"))
    write(src / "bad" / "wide.png", encode(Image.new("RGB", (66000, 17), (10, 200, 30)), "PNG"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("x.jpg")
        info.size = len(jpg)
        tf.addfile(info, io.BytesIO(jpg))
    write(src / "broken.tar", buf.getvalue()[:700])
    return root


def _ingest(corpus: Path, out: Path, **kw) -> dict:
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    return run_prepare(PrepareConfig(input=[str(corpus / "src")], output=str(out), size=32, min_short_side=16,
                                     shard_mb=0.004, test_set=[f"held_out={corpus / 'test'}"], **kw))


def _rows(path: Path) -> list[dict]:
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda r: json.dumps(r, sort_keys=True))


@pytest.fixture(scope="module")
def direct_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("direct") / "out"
    return out, _ingest(corpus, out, workers=1)


@pytest.fixture(scope="module")
def dask_run(cluster, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("dask_out") / "out"
    return out, _ingest(corpus, out, runner="dask", dask_address=cluster.address)


def test_dask_gives_the_same_shards_and_rows_as_the_direct_runner(dask_run, direct_run):
    ref_out, ref = direct_run
    out, manifest = dask_run
    assert len(ref["shards"]) > 1
    assert manifest["shards"] == ref["shards"]  # names, rows, sizes and sha256: byte-identical shards
    for shard in ref["shards"]:
        assert (out / shard["path"]).read_bytes() == (ref_out / shard["path"]).read_bytes()
    assert manifest["counts"] == ref["counts"] and manifest["label_map"] == ref["label_map"]
    c = manifest["counts"]
    assert c["inputs"] == c["written"] + c["rejected_total"] + c["duplicates_total"]
    assert c["duplicates"]["corpus"] == 1 and c["duplicates"]["held_out"] >= 1  # noisy copies match too
    for name in ("quarantine.jsonl", "duplicates.jsonl"):
        assert _rows(out / name) == _rows(ref_out / name)
    ShardSet(out).verify()
    assert not [p for p in os.listdir(out) if ".tmp-" in p or p.startswith(".staging-")]


def test_bad_inputs_are_quarantined_on_dask_with_the_direct_runners_reasons(dask_run, direct_run):
    _, ref = direct_run
    out, manifest = dask_run
    reasons = {r["uri"].split("/src/", 1)[1]: r["reason"] for r in _rows(out / "quarantine.jsonl")}
    assert reasons == BAD
    assert manifest["counts"]["rejected"] == ref["counts"]["rejected"]
    (dead,) = [r for r in _rows(out / "quarantine.jsonl") if r["reason"] == "unexpected_error"]
    assert "OSError" in dead["detail"]


# -- jobs/prepare.py: usage errors are one line, exit 2 ------------------------------------------

def _job(*args, timeout=300):
    return subprocess.run([sys.executable, JOB, *args], capture_output=True, text=True, cwd=REPO, env=_env(),
                          timeout=timeout)


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [ln for ln in stderr.splitlines() if "error" in ln.lower() and "prepare" in ln.lower()]
    return line


@pytest.mark.parametrize("args,says", [
    (["--runner", "Bogus"], "'Bogus' is not a runner prepare knows; use one of DirectRunner, direct, dask"),
    (["--runner", "apache_beam.runners.dask.dask_runner.DaskRunner"], "is not a runner prepare knows"),
    (["--runner", "dask", "--dask-address", "127.0.0.1:8786"], "expected a scheduler address like tcp://"),
    (["--dask-address", "tcp://127.0.0.1:8786"], "dask_address: needs --runner dask"),
    (["--runner", "dask", "--isolate-decoder"], "isolate_decoder: is not supported with --runner dask"),
])
def test_bad_runner_settings_exit_2_with_one_line(tmp_path, args, says):
    r = _job("--input", str(tmp_path), "--output", str(tmp_path / "o"), *args)
    assert r.returncode == 2 and says in _one_error_line(r.stderr), r.stderr[-2000:]


def test_a_dask_address_with_no_scheduler_exits_2_with_one_line(tmp_path, free_port, photos):
    write(tmp_path / "src" / "k" / "a.png", encode(photos["astronaut"], "PNG"))
    address = f"tcp://127.0.0.1:{free_port()}"
    r = _job("--input", str(tmp_path / "src"), "--output", str(tmp_path / "o"), "--runner", "dask",
             "--dask-address", address, "--beam-options=--dask_connection_timeout=2")
    line = _one_error_line(r.stderr)
    assert r.returncode == 2 and f"--dask-address {address}: no Dask scheduler answered in 2 s" in line
    assert "start one" in line
    assert not (tmp_path / "o").exists()  # refused before anything was written
    r = _job("--input", str(tmp_path / "src"), "--output", str(tmp_path / "o"), "--runner", "dask", "--dask-address")
    assert r.returncode == 2 and "dask-address" in r.stderr and "Traceback" not in r.stderr


# -- a cluster the job starts itself -------------------------------------------------------------

def test_the_local_cluster_listens_on_loopback_only_and_is_stopped(corpus, direct_run, tmp_path, tcp_listeners,
                                                                   loopback_addresses):
    if tcp_listeners is None:
        pytest.skip("reads listening sockets from /proc (Linux)")
    before = tcp_listeners()  # the module's cluster, if it runs: not the job's
    seen: set[tuple[str, int]] = set()
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.update(tcp_listeners() - before)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        manifest = _ingest(corpus, tmp_path / "out", runner="dask", workers=2)
    finally:
        done.set()
        watcher.join()
    assert manifest["shards"] == direct_run[1]["shards"]
    # Scheduler, its HTTP server, and two workers with their nannies, all on loopback.
    assert len({port for _, port in seen}) >= 6, sorted(seen)
    assert {addr for addr, _ in seen} <= loopback_addresses, sorted(seen)
    # Stopped at the end: nothing listens on those ports any more.
    assert not tcp_listeners() & seen


def test_a_run_that_cannot_complete_fails_loudly_and_shows_no_partial_shard(cluster, corpus, tmp_path):
    """A shard that cannot be moved into place (a folder sits under its name) fails the run, with no manifest."""
    import pyarrow.ipc as ipc

    out = tmp_path / "out"
    (out / "shard-00000.arrow").mkdir(parents=True)
    r = _job("--input", str(corpus / "src"), "--output", str(out), "--size", "32", "--min-short-side", "16",
             "--shard-mb", "0.004", "--runner", "dask", "--dask-address", cluster.address)
    assert r.returncode == 1 and "shard-00000.arrow" in r.stderr and "IsADirectoryError" in r.stderr
    assert not (out / "manifest.json").exists()
    for path in out.glob("shard-*.arrow"):
        if path.is_file():  # the others were written whole, or not at all
            with open(path, "rb") as f:
                assert ipc.open_file(f).read_all().num_rows > 0


# -- faults: last in the module, since it leaves the cluster one worker ----------------------------

def test_a_worker_killed_mid_run_loses_nothing(cluster, corpus, direct_run, tmp_path):
    """SIGKILL the worker holding the most results once the images start to spill: Dask runs its tasks again."""
    from distributed import Client

    _, ref = direct_run
    out = tmp_path / "out"
    cmd = [sys.executable, JOB, "--input", str(corpus / "src"), "--output", str(out), "--size", "32",
           "--min-short-side", "16", "--shard-mb", "0.004", "--test-set", f"held_out={corpus / 'test'}",
           "--runner", "dask", "--dask-address", cluster.address]
    with Client(cluster.address, set_as_default=False) as client:
        names = {addr: w["name"] for addr, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        killed, held = None, 0
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                spilled = any(out.glob(".staging-*/blobs/*.bin"))
            except FileNotFoundError:  # the run removed its staging folder as the glob listed it
                spilled = False
            if spilled:
                has_what = client.has_what()
                addr = max(has_what, key=lambda a: len(has_what[a]))
                held = len(has_what[addr])
                killed = cluster.workers[int(str(names[addr])[1:])]
                os.kill(killed.pid, signal.SIGKILL)
                break
            time.sleep(0.005)
        stdout, stderr = proc.communicate(timeout=300)
    assert killed is not None, "the job ended before any image was spilled; the kill did not happen mid-run"
    assert killed.wait(timeout=30) == -signal.SIGKILL and held > 0
    assert len(cluster.alive_workers()) == 1
    assert proc.returncode == 0, stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["shards"] == ref["shards"] and manifest["counts"] == ref["counts"]
    assert manifest["attempts"] == 1
    ShardSet(out).verify()
    assert not [p for p in os.listdir(out) if ".tmp-" in p or p.startswith(".staging-")]


@pytest.mark.parametrize("name", ["kubernetes.yaml", "jobqueue.yaml"])
def test_dask_options_files_are_valid_configs(name):
    from common.config import from_dict, load_file
    from pipelines.config import PrepareConfig

    data = load_file(REPO / "infra" / "dask" / name)
    cfg = from_dict(PrepareConfig, {**data, "input": ["s3://b/in"], "output": "s3://b/out"})
    assert cfg.runner == "dask" and all(o.startswith("--") for o in cfg.beam_options)
