"""infra/ray/local-cluster.sh as a user runs it: start, submit at once, stop."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "infra" / "ray" / "local-cluster.sh"
BIN = Path(sys.executable).parent


def test_a_submit_right_after_start_is_accepted_and_takes_the_clusters_vitscale_home(tmp_path, free_port):
    # start used to return when the dashboard answered; a submit then could fail with
    # "No available agent to submit job" (HTTP 500).
    home = tmp_path / "store"
    env = dict(os.environ, HOME=str(tmp_path), VIRTUAL_ENV=str(BIN.parent), VITSCALE_HOME=str(home),
               RAY_AUTH_MODE="token")
    for var in ("RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "MLFLOW_TRACKING_URI"):
        env.pop(var, None)
    temp = tempfile.mkdtemp(prefix="rlc", dir="/tmp")  # Ray's socket paths must stay short
    dash = free_port()
    start = subprocess.run([str(CLUSTER), "start", "--temp-dir", temp, "--num-cpus", "1", "--port", str(free_port()),
                            "--dashboard-port", str(dash)], env=env, capture_output=True, text=True, timeout=400)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        address = f"http://127.0.0.1:{dash}"
        ray = [str(BIN / "ray"), "job"]
        job = subprocess.run(ray + ["submit", "--address", address, "--", "python", "-c",
                                    "import os; print('home=' + os.environ.get('VITSCALE_HOME', 'unset'))"],
                             env=env, capture_output=True, text=True, timeout=300)
        assert job.returncode == 0, job.stdout + job.stderr
        assert f"home={home}" in job.stdout  # from the cluster's environment, no --runtime-env-json
        listed = subprocess.run(ray + ["list", "--address", address], env=env, capture_output=True, text=True,
                                timeout=120)
        assert listed.returncode == 0 and "readiness probe" not in listed.stdout  # the probe job is gone
        assert listed.stdout.count("submission_id") == 1, listed.stdout
    finally:
        subprocess.run([str(CLUSTER), "stop", "--temp-dir", temp], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
