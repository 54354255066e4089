"""The suite's CPU log (``SUITE_CPU_LOG``) and ``benchmarks/suite_cpu.py``, on a real pytest run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_logged_run_gives_each_test_its_cpu_and_the_floor_on_the_machines_cores(tmp_path):
    log = tmp_path / "cpu.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "SUITE_CPU_LOG_WRITER"}  # a session of its own
    env["SUITE_CPU_LOG"] = str(log)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/vitcore/test_flops.py::test_b16_macs_match_published_figures"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert "start" in records[0] and "finish" in records[-1] and records[-1]["exitstatus"] == 0
    (test,) = records[1:-1]
    assert test["test"] == "tests/vitcore/test_flops.py::test_b16_macs_match_published_figures"
    assert test["wall_s"] >= 0 and test["cpu_s"] >= 0

    out = subprocess.run([sys.executable, "benchmarks/suite_cpu.py", str(log)], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["benchmark"] == "suite_cpu" and report["tests"] == 1 and report["cores"] == os.cpu_count()
    # Both figures are rounded to 0.1 from the same unrounded CPU seconds.
    assert abs(report["floor_s"] - report["busy_cpu_s"] / report["cores"]) <= 0.1 and report["target_s"] == 1500
    assert report["largest_files"][0]["file"] == "tests/vitcore/test_flops.py"

    # The same file written by a second run: the figures are the last run's.
    start, test, finish = records
    log.write_text("".join(json.dumps(r) + "\n" for r in [start, {**test, "test": "older.py::t"}, finish,
                                                             start, test, finish]))
    out = subprocess.run([sys.executable, "benchmarks/suite_cpu.py", str(log)], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True)
    again = json.loads(out.stdout.strip().splitlines()[-1])
    assert again["tests"] == 1 and [f["file"] for f in again["largest_files"]] == ["tests/vitcore/test_flops.py"]


def test_a_pytest_run_inside_a_logged_test_writes_nothing(tmp_path):
    # A test that runs pytest passes SUITE_CPU_LOG on; its session is part of the test's CPU.
    log = tmp_path / "cpu.jsonl"
    env = {**os.environ, "SUITE_CPU_LOG": str(log), "SUITE_CPU_LOG_WRITER": "1"}  # the logging session's pid
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/vitcore/test_flops.py::test_b16_macs_match_published_figures"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    assert not log.exists()


def test_a_log_without_its_sessions_end_is_one_line_naming_how_to_write_it(tmp_path):
    log = tmp_path / "cut.jsonl"
    log.write_text(json.dumps({"test": "t", "wall_s": 1, "cpu_s": 1}) + '\n{"test": "cut sh')  # killed mid-line
    out = subprocess.run([sys.executable, "benchmarks/suite_cpu.py", str(log)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"suite_cpu: error: {log}: its newest run has no start or no end; write it "
                                  f"with SUITE_CPU_LOG={log} make test, and let the run end")
    missing = tmp_path / "none.jsonl"
    out = subprocess.run([sys.executable, "benchmarks/suite_cpu.py", str(missing)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"suite_cpu: error: {missing}: cannot be read (No such file or directory); write it "
                                  f"with SUITE_CPU_LOG={missing} make test, and let the run end")
