"""Every stage is its own entrypoint: --help, clear usage errors, and `ray job submit`."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOBS = ["prepare", "pretrain", "finetune", "demo"]


def run_job(name, *args, env=None, timeout=120):
    return subprocess.run([sys.executable, str(REPO / "jobs" / f"{name}.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.mark.parametrize("name", JOBS)
def test_help(name):
    out = run_job(name, "--help")
    assert out.returncode == 0, out.stderr
    assert "--config FILE" in out.stdout


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("pretrain", ["--data", "/x", "--objective", "nope"], "objective: expected one of 'classification', 'mpp'"),
        ("pretrain", ["--data", "/no/such/shards"], "data: /no/such/shards has no manifest.json"),
        ("finetune", ["--train", "/a", "--test", "/b", "--lrs", "-1"], "lrs: every learning rate must be positive"),
        ("demo", ["--epochs", "0"], "epochs: must be positive"),
    ],
)
def test_usage_errors_exit_2_and_name_the_problem(name, args, message):
    out = run_job(name, *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr
    assert "Traceback" not in out.stderr


@pytest.fixture
def ray_head(tmp_path, free_port, stop_process_group):
    """A separate `ray start --head` cluster on loopback, torn down by its process group.

    (`ray stop` would also kill the suite's own in-process Ray.)
    """
    port, dash = free_port(), free_port()
    bin_dir = Path(sys.executable).parent
    # `ray start --head` turns on token auth; clients then need RAY_AUTH_MODE=token and the token.
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", RAY_AUTH_MODE="token")
    env.pop("RAY_ADDRESS", None)
    # As infra/ray/local-cluster.sh does: without it Ray swaps 127.0.0.1 for the external address.
    head_env = dict(env, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    subprocess.run([str(bin_dir / "ray"), "get-auth-token", "--generate"], env=env, check=True,
                   capture_output=True, timeout=60)
    # Short path: Ray's unix sockets live under the temp dir and must stay under 108 bytes.
    temp = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))
    # Every agent port explicitly: the suite's in-process Ray already holds the defaults.
    agent_ports = [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                   f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=2",
         "--include-dashboard=true", f"--temp-dir={temp}", "--disable-usage-stats", *agent_ports],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=head_env, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 120
    import urllib.error
    import urllib.request

    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=2)
            break
        except urllib.error.HTTPError:
            break  # the dashboard answers (401 until a token is sent): it is up
        except OSError:
            time.sleep(1)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("ray start --head did not bring the dashboard up in 120 s")
    try:
        yield address, env, proc.pid
    finally:
        stop_process_group(proc)
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_runs_pretrain(small_demo, ray_head, tmp_path, tcp_listeners, loopback_addresses):
    address, env, head_pid = ray_head
    shards = small_demo["work"] / "shards" / "corpus"
    out_dir = tmp_path / "job_out"
    runtime_env = {"env_vars": {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}}
    cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", address,
           "--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env), "--",
           "python", "jobs/pretrain.py", "--data", str(shards), "--output", str(out_dir), "--variant", "Ti/8",
           "--depth", "1", "--img-size", "32", "--epochs", "1", "--batch-size", "32", "--num-workers", "1"]
    for _ in range(20):
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
        # The dashboard answers before its job agent has registered; the CLI says to retry.
        if "No available agent to submit job" not in out.stderr:
            break
        time.sleep(2)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "succeeded" in out.stdout + out.stderr
    summary = json.loads((out_dir / "pretrain_summary.json").read_text())
    assert (out_dir / "model.safetensors").exists() and summary["metrics"]["epoch"] == 0
    assert summary["model"] == str(out_dir / "model.safetensors")
    import mlflow  # the run is in the submitter's store, not in Ray's copy of the working dir

    run = mlflow.MlflowClient(runtime_env["env_vars"]["MLFLOW_TRACKING_URI"]).get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.params["output"] == str(out_dir)
    # The head, started as infra/ray/local-cluster.sh starts it, kept every port on loopback.
    if tcp_listeners is not None:
        found = tcp_listeners(head_pid)
        assert len(found) >= 8  # GCS, dashboard, raylet (node and object managers), agents, client server
        assert {addr for addr, _ in found} <= loopback_addresses, sorted(found)

