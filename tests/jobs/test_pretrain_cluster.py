"""`ray job submit` of pre-training on a real two-node Ray cluster on loopback: results that stay
with the user, one worker per node, a killed worker, and a resubmission that continues."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import numpy as np
import pytest

from tests.conftest import new_home

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TINY = ["--variant", "Ti/8", "--depth", "1", "--img-size", "32", "--warmup-steps", "2", "--holdout", "0.1"]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Worker port ranges come from below the kernel's ephemeral range, where `free_port()` never
# lands: Ray refuses to start (exit 1) when one of a node's named ports falls inside its own
# worker range, which a random range inside the ephemeral one did about one suite in ten.
# Each node of a run gets its own range, so workers of two nodes never race for a port.
# Above 20000, clear of the default range (10002-19999) that the suite's in-process Ray uses.
_WORKER_RANGES = iter(range(20000 + random.randrange(0, 4000, 200), max(_ephemeral_low(), 30000) - 200, 200))


def _ports(free_port) -> list[str]:
    # Every port explicit: the suite's in-process Ray and other clusters hold the defaults.
    low = next(_WORKER_RANGES)
    return [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
            f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
            f"--min-worker-port={low}", f"--max-worker-port={low + 150}"]


def wait_for_dashboard(address: str, head: subprocess.Popen, deadline: float, log: Path) -> None:
    """Until the head's dashboard answers at all (401 until a token is sent means it is up).
    On failure, the head's own output (`log`) says why."""
    while True:
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.time() > deadline or head.poll() is not None:
                pytest.fail(f"ray start --head did not bring the dashboard up (exit {head.poll()}):\n"
                            + (log.read_text()[-3000:] if log.exists() else ""))
            time.sleep(1)


@pytest.fixture(scope="module")
def cluster(free_port):
    """A head and a second node, each with one `node_slot`, joined over loopback with token auth."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", RAY_AUTH_MODE="token")
    for name in ("RAY_ADDRESS", "VITSCALE_HOME", "MLFLOW_TRACKING_URI"):
        env.pop(name, None)
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True,
                   timeout=60)
    temp = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # Ray's socket paths must stay short
    # Each node its own temp dir, as on separate machines: sharing one, the second node's runtime-env
    # agent re-unpacks (and deletes) the job's working-dir copy under the driver's feet.
    node_temp = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))
    port, dash = free_port(), free_port()
    slot = json.dumps({"node_slot": 1})
    head_log = temp / "ray-start.log"
    with open(head_log, "w") as log:
        head = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true", "--num-cpus=2",
             f"--resources={slot}", f"--ray-client-server-port={free_port()}", f"--temp-dir={temp}",
             "--disable-usage-stats", *_ports(free_port)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    procs = [head]
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 180
        wait_for_dashboard(address, head, deadline, head_log)
        node_log = node_temp / "ray-start.log"

        def start_node() -> subprocess.Popen:
            with open(node_log, "a") as log:
                return subprocess.Popen(
                    [str(BIN / "ray"), "start", "--block", f"--address=127.0.0.1:{port}",
                     "--node-ip-address=127.0.0.1", "--num-cpus=2", f"--resources={slot}", f"--temp-dir={node_temp}",
                     "--disable-usage-stats", *_ports(free_port)],
                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

        node = start_node()
        procs.append(node)
        tries = 1
        while "/2.0 node_slot" not in subprocess.run(
                [str(BIN / "ray"), "status", f"--address=127.0.0.1:{port}"], env=env, capture_output=True,
                text=True, timeout=60).stdout:
            if node.poll() is not None and tries < 2 and time.time() < deadline:
                # On a machine loaded far past its cores, joining can time out inside `ray start`;
                # one more try, and the failure below shows both attempts' output.
                tries += 1
                node = start_node()
                procs.append(node)
            elif time.time() > deadline or node.poll() is not None:
                pytest.fail(f"the second node did not join the cluster ({tries} tries):\n"
                            + node_log.read_text()[-3000:])
            time.sleep(2)
        yield {"address": address, "env": env, "pids": [p.pid for p in procs]}
    finally:
        # Killed outright, as the loopback head below: a graceful stop of the nodes took 30 s of
        # teardown and leaves nothing that the temp dirs' removal does not.
        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:  # the whole group has exited already
                pass
            p.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(node_temp, ignore_errors=True)


def submit(cluster, job_args, *, runtime_env=None, wait=True, submission_id=None):
    cmd = [str(BIN / "ray"), "job", "submit", "--address", cluster["address"], "--working-dir", "."]
    if runtime_env is not None:
        cmd += ["--runtime-env-json", json.dumps(runtime_env)]
    if submission_id:
        cmd += ["--submission-id", submission_id]
    if not wait:
        cmd.append("--no-wait")
    cmd += ["--", "python", "jobs/pretrain.py", *job_args]
    for _ in range(30):
        out = subprocess.run(cmd, cwd=REPO, env=cluster["env"], capture_output=True, text=True, timeout=600)
        # The dashboard answers before its job agent has registered; the CLI says to retry.
        if "No available agent to submit job" not in out.stderr:
            return out
        time.sleep(2)
    return out


def job_logs(cluster, submission_id):
    return subprocess.run([str(BIN / "ray"), "job", "logs", "--address", cluster["address"], submission_id],
                          env=cluster["env"], capture_output=True, text=True, timeout=120).stdout


def job_status(cluster, submission_id):
    """PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED, from the dashboard's jobs API (what `ray job
    status` asks, without starting a Python that imports Ray for every poll); else the reply."""
    env = cluster["env"]
    token = env.get("RAY_AUTH_TOKEN") or Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token") \
        .read_text().strip()
    request = urllib.request.Request(f"{cluster['address']}/api/jobs/{submission_id}",
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.load(reply)["status"]
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read()[:2000]!r}"
    except OSError as exc:  # a dashboard too busy to answer: the callers poll again or show the job's logs
        return f"no answer: {exc}"


def wait_for(cluster, submission_id, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = job_status(cluster, submission_id)
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return status
        time.sleep(2)
    pytest.fail(f"job {submission_id} did not finish in {timeout} s")


def train_workers(roots: list[int]) -> list[int]:
    """Pids of `ray::RayTrainWorker` processes descended from this cluster's nodes."""
    parent, title = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    title[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
    found = []
    for pid, args in title.items():
        if not args.startswith("ray::RayTrainWorker"):
            continue
        p = pid
        while p > 1 and p not in roots:
            p = parent.get(p, 1)
        if p in roots:
            found.append(pid)
    return found


def test_local_cluster_refuses_to_start_outside_the_project_env(tmp_path):
    env = dict(os.environ, VIRTUAL_ENV=str(tmp_path / "some-other-venv"))
    out = subprocess.run([str(REPO / "infra" / "ray" / "local-cluster.sh"), "start", "--temp-dir", str(tmp_path / "t")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "lacks the project's dependencies" in line and "activate the project's venv" in line
    assert not (tmp_path / "t" / "local-cluster.pid").exists()


@pytest.fixture(scope="module")
def corpus(small_demo):
    return small_demo["work"] / "shards" / "corpus"


def test_readme_submit_keeps_the_run_in_the_users_store(cluster, corpus, tmp_path):
    readme = (REPO / "docs" / "scale-out.md").read_text()
    assert ('--runtime-env-json "{\\"env_vars\\": {\\"VITSCALE_HOME\\": \\"$HOME/vitscale\\"}}"' in readme
            and "-- python jobs/pretrain.py --config configs/pretrain-demo-tiny.yaml --data /shared/shards "
                "--output runs/tiny" in readme)
    home = tmp_path / "vitscale"
    before = set(os.listdir(REPO))
    # As docs/scale-out.md prints it, shrunk to test size by later flags.
    out = submit(cluster, ["--config", "configs/pretrain-demo-tiny.yaml", "--data", str(corpus), "--output", "runs/tiny",
                           *TINY, "--steps", "4", "--batch-size", "8", "--log-every", "2"],
                 runtime_env={"env_vars": {"VITSCALE_HOME": str(new_home(home))}})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((home / "runs" / "tiny" / "pretrain_summary.json").read_text())
    assert summary["model"] == str(home / "runs" / "tiny" / "model.safetensors") and Path(summary["model"]).is_file()
    assert summary["steps"] == 4
    run = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_run(summary["mlflow_run_id"])
    assert run.data.metrics["steps"] == 4 and run.data.params["output"] == str(home / "runs" / "tiny")
    assert set(os.listdir(REPO)) == before  # nothing landed beside the code


def test_submit_refuses_an_output_that_would_vanish(cluster, corpus):
    out = submit(cluster, ["--data", str(corpus), *TINY, "--steps", "2", "--batch-size", "8"],
                 submission_id=f"refuse-{os.getpid()}-{time.time_ns()}")
    assert out.returncode != 0
    logs = out.stdout + out.stderr
    assert ("pretrain: error: output: 'pretrain_output' is relative and this job runs in Ray's uploaded copy of the "
            "working dir") in logs and "VITSCALE_HOME" in logs
    assert "Traceback" not in logs


def test_two_workers_one_per_node(cluster, corpus, tmp_path):
    sid = f"two-node-{os.getpid()}-{time.time_ns()}"
    out_dir = tmp_path / "two"
    # The store named by MLFLOW_TRACKING_URI this time (the scale-out doc's test uses VITSCALE_HOME).
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = submit(cluster, ["--data", str(corpus), "--output", str(out_dir), *TINY, "--steps", "6", "--batch-size", "8",
                           "--num-workers", "2", "--resources-per-worker", '{"node_slot": 1}', "--checkpoint-every", "3"],
                 runtime_env={"env_vars": {"MLFLOW_TRACKING_URI": store}}, submission_id=sid)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((out_dir / "pretrain_summary.json").read_text())
    assert summary["nodes"] == 2, job_logs(cluster, sid)[-3000:]  # one worker on each node
    assert summary["steps"] == 6 and summary["restarts"] == 0
    assert summary["model"] == str(out_dir / "model.safetensors") and Path(summary["model"]).is_file()
    run = mlflow.MlflowClient(store).get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["steps"] == 6


def test_killed_worker_restarts_and_resubmission_continues(cluster, corpus, tmp_path):
    from pipelines.schema import ShardSet
    from training.data import holdout_mask, shard_keys
    from training.trainer import epoch_rows

    out_dir, home = tmp_path / "kill", tmp_path / "home"
    args = ["--data", str(corpus), "--output", str(out_dir), "--run-name", "kill", *TINY, "--batch-size", "8",
            "--checkpoint-every", "20", "--log-every", "20", "--max-failures", "2", "--num-workers", "1"]
    env = {"env_vars": {"VITSCALE_HOME": str(new_home(home))}}
    sid = f"kill-{os.getpid()}-{time.time_ns()}"
    out = submit(cluster, [*args, "--steps", "400"], runtime_env=env, wait=False, submission_id=sid)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = out_dir / "ray" / "kill"
    deadline = time.time() + 400
    # Wait until Ray Train has registered a checkpoint (its snapshot lists one): a checkpoint folder
    # alone may belong to a report the controller has not collected yet, which a kill would lose.
    snapshot = run_dir / "checkpoint_manager_snapshot.json"

    def registered() -> bool:
        try:
            return bool(json.loads(snapshot.read_text()).get("checkpoint_results"))
        except (OSError, ValueError):
            return False

    while not registered():
        assert time.time() < deadline and job_status(cluster, sid) in ("PENDING", "RUNNING"), job_logs(cluster, sid)[-3000:]
        time.sleep(0.2)
    (victim,) = train_workers(cluster["pids"])
    os.kill(victim, signal.SIGKILL)
    assert wait_for(cluster, sid) == "SUCCEEDED", job_logs(cluster, sid)[-3000:]

    summary = json.loads((out_dir / "pretrain_summary.json").read_text())
    assert summary["steps"] == 400 and summary["restarts"] == 1
    # The restarted worker group began at a checkpoint, not at step 0.
    assert summary["resumed_from_step"] > 0 and summary["resumed_from_step"] % 20 == 0
    run = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_run(summary["mlflow_run_id"])
    assert run.data.metrics["restarts"] == 1 and run.data.metrics["steps"] == 400
    # The rows trained on in the final epoch are exactly the epoch's first `offset` batches:
    # the restart neither replayed nor skipped one.
    pos = summary["data_position"]
    shards = ShardSet(str(corpus))
    train_rows = np.flatnonzero(~holdout_mask(shard_keys(shards), 0.1))
    seen = train_rows[epoch_rows(len(train_rows), 1, 0, 0, pos["epoch"])[: pos["offset"] * 8]]
    assert pos["rows_seen_in_epoch"] == len(seen) == pos["offset"] * 8
    assert pos["rows_sum"] == int(seen.sum()) and pos["rows_sumsq"] == int((seen * seen).sum())

    # The same run submitted again with a longer budget continues from step 400.
    out = submit(cluster, [*args, "--steps", "420"], runtime_env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    again = json.loads((out_dir / "pretrain_summary.json").read_text())
    assert again["steps"] == 420 and again["resumed_from_step"] == 400 and again["restarts"] == 0


def test_a_head_started_as_local_cluster_sh_does_listens_on_loopback_only(free_port, tcp_listeners, loopback_addresses):
    """infra/ray/local-cluster.sh's head (multi-node support off): every port on 127.0.0.1.

    The two-node cluster above cannot be loopback-only: with multi-node support on, Ray 2.60
    binds each node's external address whatever --node-ip-address says, which is what nodes
    on separate machines need. A single-machine head turns it off, as the script does.
    """
    if tcp_listeners is None:
        pytest.skip("reads /proc")
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", RAY_AUTH_MODE="token",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True,
                   timeout=60)
    temp = Path(tempfile.mkdtemp(prefix="rl", dir="/tmp"))
    dash = free_port()
    head_log = temp / "ray-start.log"
    with open(head_log, "w") as log:
        head = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={free_port()}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true", "--num-cpus=1",
             f"--ray-client-server-port={free_port()}", f"--temp-dir={temp}", "--disable-usage-stats", *_ports(free_port)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for_dashboard(f"http://127.0.0.1:{dash}", head, time.time() + 180, head_log)
        # The agents open their ports after the dashboard: a fixed 3 s wait saw too few under load.
        deadline, found = time.time() + 120, tcp_listeners(head.pid)
        while len(found) < 8 and time.time() < deadline:
            time.sleep(0.5)
            found = tcp_listeners(head.pid)
        time.sleep(1)
        found = tcp_listeners(head.pid)
        assert len(found) >= 8, found  # GCS, dashboard, raylet's node and object managers, agents, client server
        assert {addr for addr, _ in found} <= loopback_addresses, sorted(found)
    finally:
        # Nothing of this head is worth a graceful stop (on TERM it takes 30 s to go).
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)
