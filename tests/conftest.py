"""Fixtures shared across the suite: one Ray instance for the whole session, a throwaway MLflow store."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _stop_pytest(signum, frame):
    """SIGTERM stops the run as Ctrl-C does: the session's fixtures (Ray, servers) are torn down."""
    raise KeyboardInterrupt(f"pytest stopped by {signal.Signals(signum).name}")


# The SIGINT and SIGTERM handlers the whole run keeps, put back after each phase of each test.
_SUITE_HANDLERS: dict[int, object] = {}


def _cpu_logging() -> bool:
    """Whether this pytest process writes ``SUITE_CPU_LOG``: not when it runs inside a test of a
    pytest that writes the same file (a test that runs pytest passes the variable on)."""
    log = os.environ.get("SUITE_CPU_LOG")
    return bool(log) and os.environ.get("SUITE_CPU_LOG_WRITER", str(os.getpid())) == str(os.getpid())


def pytest_sessionstart(session):
    if _cpu_logging():
        os.environ["SUITE_CPU_LOG_WRITER"] = str(os.getpid())
        _cpu_log({"start": time.time()}, machine=True)
    _SUITE_HANDLERS[signal.SIGINT] = signal.getsignal(signal.SIGINT)
    _SUITE_HANDLERS[signal.SIGTERM] = _stop_pytest
    signal.signal(signal.SIGTERM, _stop_pytest)


def _cpu_log(record: dict, *, machine: bool = False) -> None:
    """One line of ``SUITE_CPU_LOG``; a session's start and finish also carry the machine's busy CPU."""
    if machine:
        from benchmarks.machine import busy_cpu_s, describe

        record = {**record, "busy_cpu_s": busy_cpu_s(), "machine": describe()}
    with open(os.environ["SUITE_CPU_LOG"], "a") as f:
        f.write(json.dumps(record) + "\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``SUITE_CPU_LOG=FILE``: a JSON line per test, its wall time and the CPU seconds the whole
    machine spent busy meanwhile (the set-up of a shared fixture it was first to use included), for
    ``benchmarks/suite_cpu.py``."""
    if not _cpu_logging():
        return (yield)
    from benchmarks.machine import busy_cpu_s

    start, busy = time.monotonic(), busy_cpu_s()
    try:
        return (yield)
    finally:
        _cpu_log({"test": item.nodeid, "wall_s": round(time.monotonic() - start, 2),
                  "cpu_s": round(busy_cpu_s() - busy, 2)})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep SIGTERM able to stop the run.

    ``ray.init`` in this process (the ``ray_session`` fixture, or a stage a test runs) leaves its
    own SIGTERM handler, which raises ``SystemExit(15)``: pytest counted that as one failed test
    and went on. That handler, or a stage's :func:`common.cli.interrupts`, can still take a
    SIGTERM in the phase that installed it: the run stops after that test.
    """
    report = yield
    exc = call.excinfo.value if call.excinfo is not None else None
    if (isinstance(exc, SystemExit) and exc.code == signal.SIGTERM) or getattr(exc, "signum", None) == signal.SIGTERM:
        item.session.shouldstop = f"{item.nodeid} was stopped by SIGTERM"
    for signum, handler in _SUITE_HANDLERS.items():
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)
    return report


def pytest_sessionfinish(session, exitstatus):
    if _cpu_logging():
        _cpu_log({"finish": time.time(), "exitstatus": int(exitstatus)}, machine=True)


@pytest.fixture(autouse=True)
def _no_tracking_uri_leaks():
    """Undo the ``MLFLOW_TRACKING_URI`` that ``mlflow.set_tracking_uri`` exports to os.environ.

    MLflow sets it so that subprocesses inherit the store; inside one pytest process it would
    send every later test's runs to the first store a test used, whatever that test's
    ``VITSCALE_HOME`` says.
    """
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


_JOBS: dict[str, object] = {}


def _job_main(capfd, cwd: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    if name not in _JOBS:
        spec = importlib.util.spec_from_file_location(f"_job_{name}", REPO / "jobs" / f"{name}.py")
        _JOBS[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_JOBS[name])
    capfd.readouterr()
    environ, before = dict(os.environ), os.getcwd()  # run_job records --verbose there for the job's processes
    os.chdir(cwd)
    try:
        returncode = _JOBS[name].main(list(args))
    except SystemExit as exc:  # argparse's refusals
        returncode = exc.code
    finally:
        os.chdir(before)
        os.environ.clear()
        os.environ.update(environ)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([f"jobs/{name}.py", *args], returncode, out, err)


@pytest.fixture
def job_main(capfd, tmp_path):
    """``job_main(name, *args)`` -> ``jobs/<name>.py``'s ``main(args)`` run in this process, in the
    test's ``tmp_path``, as a ``CompletedProcess`` with its exit status and the stdout and stderr it
    wrote (file descriptors included). For a refusal's message: it skips a fresh interpreter's
    imports, not the job's code."""
    return lambda name, *args: _job_main(capfd, tmp_path, name, *args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_process_group(proc: subprocess.Popen) -> None:
    """Stop a server started with ``start_new_session=True``, children included: TERM, then KILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # the whole group has exited already
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def free_port():
    """``free_port()`` -> a TCP port on 127.0.0.1 that nothing listens on now."""
    return _free_port


@pytest.fixture(scope="session")
def stop_process_group():
    """``stop_process_group(proc)`` for the local servers (Ray head, MLflow) a test starts."""
    return _stop_process_group


LOOPBACK = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})


def _process_tree(root: int) -> set[int]:
    """``root`` and every process descended from it, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # the name may hold spaces
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(children.get(pid, ()))
    return tree


def _tcp_listeners(root: int | None = None) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket that ``root`` (default: this process) or a descendant listens on."""
    inodes = set()
    for pid in _process_tree(root or os.getpid()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hex_ip, hex_port = cols[1].split(":")
                raw = bytes.fromhex(hex_ip)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
                found.add((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return found


@pytest.fixture(scope="session")
def tcp_listeners():
    """``tcp_listeners(pid=this process)`` -> {(address, port)} listened on by ``pid`` and its descendants.

    Read from /proc, so Linux only: elsewhere it is None, and tests skip or leave out that check.
    """
    return _tcp_listeners if os.path.isdir("/proc/self/fd") else None


@pytest.fixture(scope="session")
def loopback_addresses():
    """What a loopback listener shows as: IPv4, IPv6, and IPv4 on a dual-stack socket."""
    return LOOPBACK


# A reader of a shard set in a process of its own: it takes the set's readers' lock, says so, and
# holds it until its stdin closes.
_HOLD_READERS_LOCK = ("import sys; from common.locks import DataLock; "
                      "lock = DataLock(sys.argv[1], sys.argv[2]); assert lock.acquire(); print('held', flush=True); "
                      "sys.stdin.read(); lock.release()")


@contextlib.contextmanager
def _reader_process(folder, stage: str = "pretrain"):
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_READERS_LOCK, str(folder), stage], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            proc.wait(timeout=30)


@pytest.fixture(scope="session")
def reader_process():
    """``with reader_process(folder, stage) as proc:`` -> another process (``proc.pid``) that holds the
    shard set ``folder``'s readers' lock, as a ``stage`` run reading it does, until the block ends."""
    return _reader_process


@pytest.fixture(scope="session")
def ray_session():
    """Ray started once, in-process, for every test that needs it (starting Ray costs seconds).

    Four logical CPUs on a two-core machine: Ray Train's two workers plus Tune trials must be
    schedulable together, and they are mostly waiting on each other in these small runs.
    """
    import ray

    from training.ray_utils import init_ray

    init_ray(num_cpus=4)
    yield ray
    ray.shutdown()


def _make_pretrained(path: Path, *, img_size: int, representation_size: int) -> Path:
    """A 2-block Ti/8 with a representation layer, saved as vitcore's checkpoint format."""
    import torch

    import vitcore

    torch.manual_seed(0)
    model = vitcore.create_model("Ti/8", num_classes=7, img_size=img_size, depth=2,
                                 representation_size=representation_size)
    vitcore.save_checkpoint(model, path)
    return path


@pytest.fixture(scope="session")
def build_pretrained():
    return _make_pretrained


_STORE_TEMPLATE: list[Path] = []


def new_home(home: Path) -> Path:
    """``home`` made ready as a ``VITSCALE_HOME``: its MLflow store a copy of one this process migrated.

    MLflow creates a new sqlite store with its migrations, about 3 s of CPU on a 2-core machine;
    a suite run opens about 80. The first call makes one through :mod:`common.tracking` as a job
    would; later calls copy it and point its Default experiment at their own ``artifacts/0``, which
    is what a store created in ``home`` holds. A store already there is kept. A test of how a store
    is created uses a bare folder.
    """
    import atexit
    import shutil
    import sqlite3
    import tempfile

    if not _STORE_TEMPLATE:
        from common import tracking

        folder = Path(tempfile.mkdtemp(prefix="vitscale-store-"))
        atexit.register(shutil.rmtree, folder, True)
        tracking._ensure_sqlite_store(f"sqlite:///{folder / 'mlflow.db'}")
        _STORE_TEMPLATE.append(folder / "mlflow.db")
    home.mkdir(parents=True, exist_ok=True)
    if (home / "mlflow.db").exists():
        return home
    shutil.copyfile(_STORE_TEMPLATE[0], home / "mlflow.db")
    now = int(time.time() * 1000)
    with contextlib.closing(sqlite3.connect(home / "mlflow.db")) as con, con:
        con.execute("UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                    "WHERE experiment_id = 0", (f"{(home / 'artifacts').as_uri()}/0", now, now))
    return home


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory):
    """A throwaway sqlite MLflow store (``VITSCALE_HOME``) for one test module: the suite's only one.

    Module-scoped so that module-scoped fixtures which run a stage (an ingest, say) log into
    it too; it is undone after the module, so the setting never leaks into another one.
    """
    home = new_home(tmp_path_factory.mktemp("vitscale_home"))
    mp = pytest.MonkeyPatch()
    mp.setenv("VITSCALE_HOME", str(home))
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "VITSCALE_PARENT_RUN_ID"):
        mp.delenv(var, raising=False)
    yield home
    mp.undo()


def mlflow_client():
    import mlflow

    from common import tracking

    return mlflow.MlflowClient(tracking.tracking_uri())


# A demo run shrunk to test size: the same stages, far fewer images and steps.
SMALL_DEMO = dict(
    per_shape=10, per_photo=5, epochs=2, batch_size=32, finetune_steps=12, finetune_batch_size=32,
    lrs=[0.01, 0.1], num_workers=2, prepare_workers=2,
    vtab_train=24, vtab_val=8, vtab_test=16, vtab_lrs=[0.1], vtab_steps=[2, 4],
)


@pytest.fixture(scope="session")
def small_demo(tmp_path_factory, ray_session):
    """Run the whole demo chain once (Beam → Ray Train → Ray Tune → MLflow) and share its outputs."""
    from demo.run import DemoConfig, run_demo

    work = tmp_path_factory.mktemp("demo")
    mp = pytest.MonkeyPatch()
    mp.setenv("VITSCALE_HOME", str(new_home(work / "mlruns")))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.delenv("VITSCALE_PARENT_RUN_ID", raising=False)
    try:
        summary = run_demo(DemoConfig(workdir=str(work), **SMALL_DEMO))
        yield {"work": work, "summary": summary, "home": work / "mlruns"}
    finally:
        mp.undo()


@pytest.fixture(scope="session")
def pool():
    """The dedup calibration's photo pool: bundled photographs and their textured tiles."""
    from dedup.calibration import photo_pool

    return photo_pool()


@pytest.fixture(scope="session")
def photos(pool):
    """Whole photographs (not tiles), by name."""
    return {name: img for name, img in pool if "@" not in name}


@pytest.fixture(scope="session")
def tiles(pool):
    return [img for name, img in pool if "@" in name]


def _prepared(root: Path) -> Path:
    """``root/src`` prepared at 32 px into ``root/shards``, its ingest logged to a store of its own."""
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    mp = pytest.MonkeyPatch()
    mp.setenv("VITSCALE_HOME", str(new_home(root / "home")))
    try:
        run_prepare(PrepareConfig(input=[str(root / "src")], output=str(root / "shards"), size=32, workers=1))
    finally:
        mp.undo()
    return root / "shards"


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory):
    """A real shard set of 16 photo crops in two classes, prepared at 32 px: enough for the stages'
    checks, interrupts and resumes. Its ingest logs to a store of its own."""
    from common.photos import crop_folder

    root = tmp_path_factory.mktemp("tiny")
    crop_folder(root / "src")
    return _prepared(root)


@pytest.fixture(scope="session")
def unlabelled_shards(tmp_path_factory):
    """A real shard set of 16 photo crops with no labels (a flat folder), prepared at 32 px."""
    from common.photos import photo

    root = tmp_path_factory.mktemp("unlabelled")
    (root / "src").mkdir()
    img = photo("chelsea.png")
    for i in range(16):
        img.crop((i * 10, i * 5, i * 10 + 200, i * 5 + 200)).save(root / "src" / f"{i}.png")
    return _prepared(root)



# Under ``-n``, a worker takes the next test file when it is free: the longest go first, so neither
# worker is left with a long one at the end. The files that read the shared demo chain, then the
# files whose tests start clusters, interrupt stages or sweep (``--durations`` of a whole run shows them).
_LONG_FIRST = ("small_demo", "tests/pipelines/test_benchmark.py", "tests/training/test_interrupt.py",
               "tests/training/test_resume_guard.py", "tests/jobs/test_entrypoints.py",
               "tests/training/test_trainer.py", "tests/training/test_knobs.py", "tests/transfer/test_vtab.py",
               "tests/infra/test_local_cluster.py", "tests/training/test_progress.py",
               "tests/pipelines/test_job.py", "tests/transfer/test_label_names.py")


def pytest_collection_modifyitems(config, items):
    """The order ``pytest -n 2 --dist loadfile`` (``make test``) queues test files in: each file runs
    on one worker (its module fixtures are built once), and a worker that runs a reader of the demo
    chain builds ``small_demo`` once. Only on an xdist worker; a plain run keeps pytest's order."""
    if not hasattr(config, "workerinput"):
        return
    rank = {group: i for i, group in enumerate(_LONG_FIRST)}

    def key(item):
        group = "small_demo" if "small_demo" in getattr(item, "fixturenames", ()) else item.nodeid.split("::")[0]
        return rank.get(group, len(rank))

    items.sort(key=key)
