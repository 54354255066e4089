"""The DirectRunner's multi-process servers listen on loopback only, and its workers stay quiet."""
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

from pipelines.config import PrepareConfig
from pipelines.ingest import pipeline_options
from pipelines.local_runner import loopback_address

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_loopback_address_rewrites_only_wildcards():
    assert loopback_address("[::]:0") == "localhost:0"
    assert loopback_address("0.0.0.0:8080") == "localhost:8080"
    assert loopback_address(":7") == "localhost:7"
    assert loopback_address("localhost:0") == "localhost:0"
    assert loopback_address("10.1.2.3:50051") == "10.1.2.3:50051"  # an address someone chose stays


def test_multi_worker_direct_runner_listens_on_loopback_only(tmp_path, tcp_listeners, loopback_addresses):
    import apache_beam as beam

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
        with beam.Pipeline(options=opts) as p:
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
        from pipelines.ingest import pipeline_options

        def probe(x):
            logging.getLogger("pipelines.probe").warning("project-warning-%d", x)
            logging.getLogger("elsewhere").warning("library-warning-%d", x)
            return x

        opts = pipeline_options(PrepareConfig(input=[{str(tmp_path)!r}], output={str(tmp_path / "o")!r}, workers=2))
        with beam.Pipeline(options=opts) as p:
            _ = p | beam.Create([7]) | beam.Map(probe)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=True)
    assert "project-warning-7" in out.stderr
    assert "library-warning-7" not in out.stderr
    for chatter in ("Python sdk harness starting", "Pipeline_options", "Discarding unparseable args"):
        assert chatter not in out.stderr
