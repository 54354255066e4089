"""The ingest on a real Dask cluster: a ``dask scheduler`` and two ``dask worker`` processes on loopback.

The cluster is started once for the module with the CLIs the ``dask[distributed]`` package
installs, each worker a separate process with no nanny, so that a test can kill one by its pid.
The workers import this checkout's code through ``PYTHONPATH``, as a real deployment imports
the installed project. The worker-kill test runs last: after it one worker is left.
"""
from __future__ import annotations

import json
import os
import shutil
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
        self.scheduler = self._start("scheduler", ["scheduler", "--host", "127.0.0.1", "--port", str(self.port),
                                                   "--no-dashboard"])
        self.workers = [
            self._start(f"worker{i}", ["worker", self.address, "--host", "127.0.0.1", "--nthreads", "1",
                                       "--no-nanny", "--no-dashboard", "--name", f"w{i}",
                                       "--local-directory", str(tmp / f"w{i}")])
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
