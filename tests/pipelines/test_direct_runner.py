"""The DirectRunner's multi-worker modes: no time-based flush race, loopback servers, quiet workers."""
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pipelines.config import PrepareConfig
from pipelines.direct_runner import direct_runner, loopback_address
from pipelines.runners import pipeline_options
from tests.conftest import new_home

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_loopback_address_rewrites_only_wildcards():
    assert loopback_address("[::]:0") == "localhost:0"
    assert loopback_address("0.0.0.0:8080") == "localhost:8080"
    assert loopback_address(":7") == "localhost:7"
    assert loopback_address("localhost:0") == "localhost:0"
    assert loopback_address("10.1.2.3:50051") == "10.1.2.3:50051"  # an address someone chose stays


def test_multi_worker_direct_runner_listens_on_loopback_only(tmp_path, tcp_listeners, loopback_addresses):
    import apache_beam as beam

    if tcp_listeners is None:
        pytest.skip("reads listening sockets from /proc (Linux)")

    opts = pipeline_options(PrepareConfig(input=[str(tmp_path)], output=str(tmp_path / "out"), workers=2))
    seen: set[tuple[str, int]] = set()
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.update(tcp_listeners())
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with beam.Pipeline(runner=direct_runner(opts), options=opts) as p:
            _ = p | beam.Create(range(4)) | beam.Map(lambda x: time.sleep(0.3) or x)
    finally:
        done.set()
        watcher.join()
    assert len({port for _, port in seen}) >= 4  # control, data, state, logging at least
    assert {addr for addr, _ in seen} <= loopback_addresses, sorted(seen)


def test_workers_keep_quiet_but_project_warnings_get_through(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import logging, sys
        sys.path.insert(0, {str(ROOT)!r})
        import apache_beam as beam
        from pipelines.config import PrepareConfig
        from pipelines.runners import pipeline_options
        from pipelines.direct_runner import direct_runner

        def probe(x):
            logging.getLogger("pipelines.probe").warning("project-warning-%d", x)
            logging.getLogger("elsewhere").warning("library-warning-%d", x)
            return x

        opts = pipeline_options(PrepareConfig(input=[{str(tmp_path)!r}], output={str(tmp_path / "o")!r}, workers=2))
        with beam.Pipeline(runner=direct_runner(opts), options=opts) as p:
            _ = p | beam.Create([7]) | beam.Map(probe)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=True)
    assert "project-warning-7" in out.stderr
    assert "library-warning-7" not in out.stderr
    for chatter in ("Python sdk harness starting", "Pipeline_options", "Discarding unparseable args"):
        assert chatter not in out.stderr


def _written_and_received(stream_cls, **kwargs) -> tuple[int, int]:
    """Write 40 KB elements to a Beam data stream as a bundle thread does; count what its callbacks get."""
    from apache_beam.coders.coders import BytesCoder
    from apache_beam.coders.stream import InputStream

    coder = BytesCoder().get_impl()
    chunks: list[bytes] = []
    stream = stream_cls(close_callback=chunks.append, flush_callback=chunks.append, **kwargs)
    written = 3000
    for _ in range(written):
        coder.encode_to_stream(b"x" * 40_000, stream, True)
        stream.maybe_flush()
    stream.close()
    received = 0
    for chunk in chunks:
        data = InputStream(chunk)
        while data.size() > 0:
            coder.decode_from_stream(data, True)
            received += 1
    return written, received


def test_the_worker_reaper_gives_logging_and_the_thread_excepthook_back_when_closed():
    import logging

    from pipelines.direct_runner import WorkerReaper

    level, hook = logging.root.manager.disable, threading.excepthook
    reaper = WorkerReaper()
    reaper()  # the signal came: the teardown's broken-stream logs are dropped
    assert logging.root.manager.disable == logging.CRITICAL and threading.excepthook is not hook
    reaper()  # a second signal keeps what the first one found
    reaper.close()
    assert logging.root.manager.disable == level and threading.excepthook is hook


def test_beams_time_based_flush_drops_elements_and_size_based_does_not():
    """Why flush_by_size_only exists. If the first half fails after a Beam upgrade, the race may be fixed."""
    from apache_beam.runners.worker.data_plane import (
        SizeBasedBufferingClosableOutputStream,
        TimeBasedBufferingClosableOutputStream,
    )

    # A 1 ms flush period and frequent thread switches make the race show within one stream (about
    # 10% of the elements here); at Beam's 1000 ms and 5 ms switches it is rarer, not gone.
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        lost = 0
        for _ in range(5):
            written, received = _written_and_received(TimeBasedBufferingClosableOutputStream,
                                                      time_flush_threshold_ms=1)
            lost += written - received
            if lost:
                break
    finally:
        sys.setswitchinterval(switch)
    assert lost > 0
    written, received = _written_and_received(SizeBasedBufferingClosableOutputStream, size_flush_threshold=1 << 20)
    assert received == written


def test_multi_worker_options_turn_off_the_time_based_flush(tmp_path):
    from apache_beam.runners.portability.fn_api_runner import worker_handlers
    from apache_beam.runners.worker.data_plane import ClosableOutputStream, SizeBasedBufferingClosableOutputStream

    pipeline_options(PrepareConfig(input=[str(tmp_path)], output=str(tmp_path / "o"), workers=2))
    assert worker_handlers.DATA_BUFFER_TIME_LIMIT_MS == 0
    # What the runner's data servicer and its embedded workers now build for each stream.
    stream = ClosableOutputStream.create(None, None, worker_handlers.DATA_BUFFER_TIME_LIMIT_MS)
    assert type(stream) is SizeBasedBufferingClosableOutputStream


def test_the_ingest_runs_on_the_fn_api_runner_without_trying_prism(tmp_path, photos):
    # Beam 2.77's DirectRunner tries PrismRunner first, which downloads a binary when online
    # and, offline, leaves an empty beam-temp* folder in the temp dir on every run.
    src, tmp = tmp_path / "src" / "a", tmp_path / "tmp"
    src.mkdir(parents=True)
    tmp.mkdir()
    for name in sorted(photos)[:2]:
        photos[name].convert("RGB").resize((64, 64)).save(src / f"{pathlib.Path(name).stem}.png")
    for workers in ("1", "2"):
        out = subprocess.run([sys.executable, str(ROOT / "jobs" / "prepare.py"), "--input", str(src.parent),
                              "--output", str(tmp_path / f"out{workers}"), "--size", "32", "--workers", workers],
                             capture_output=True, text=True, timeout=300, cwd=ROOT,
                             env={**os.environ, "TMPDIR": str(tmp), "VITSCALE_HOME": str(new_home(tmp_path / "home"))})
        assert out.returncode == 0, out.stderr[-2000:]
        assert not list(tmp.glob("beam-temp*")), workers
