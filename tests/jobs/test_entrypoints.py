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
JOBS = ["prepare", "dedup", "pretrain", "finetune", "demo", "vtab", "vtab_prepare", "fewshot"]


def run_job(name, *args, env=None, timeout=120):
    return subprocess.run([sys.executable, str(REPO / "jobs" / f"{name}.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def error_lines(out, name):
    """The job's own error lines on stderr (libraries may log warnings at import)."""
    return [line for line in out.stderr.splitlines() if line.startswith(f"{name}: ")]


def assert_one_line_exit_2(out, name, message):
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "usage:" not in out.stderr, out.stderr
    lines = error_lines(out, name)
    assert len(lines) == 1 and message in lines[0], out.stderr


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
        ("finetune", ["--train", "/a", "--test", "/b", "--microbatch", "100"],
         "microbatch: --batch-size 512 must be a multiple of --microbatch 100"),
        ("vtab", ["--output", "/tmp/x"], "task: give --data-root DIR or at least one --task NAME=DIR"),
        ("vtab", ["--task", "dtd"], "task: 'dtd': expected NAME=SRC"),
        ("vtab", ["--task", "dtd=/no/such/dtd"], "task dtd: /no/such/dtd does not exist; prepare it with: "
                                                 "python jobs/vtab_prepare.py --source tfds --task dtd"),
        ("vtab_prepare", ["--source", "tfds", "--task", "nope", "--output", "/tmp/x"], "task: 'nope' is not a registry task"),
        ("fewshot", ["--pretrained", "/no/m.safetensors", "--task", "dtd=/x"], "pretrained: /no/m.safetensors does not exist"),
    ],
)
def test_usage_errors_exit_2_and_name_the_problem(name, args, message):
    out = run_job(name, *args)
    assert_one_line_exit_2(out, name, message)


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("prepare", ["--input", "{tmp}/no_corpus", "--output", "{tmp}/out"], "input: {tmp}/no_corpus: input not found"),
        ("dedup", ["--shards", "{tmp}/no_shards", "--test-set", "cifar10={tmp}"], "{tmp}/no_shards: no manifest.json"),
        ("pretrain", ["--data", "{tmp}/no_shards"], "data: {tmp}/no_shards has no manifest.json"),
        ("finetune", ["--train", "{tmp}/no_train", "--test", "{tmp}/no_test"], "train: {tmp}/no_train has no manifest.json"),
        ("demo", ["--workdir", "{tmp}/a_file"], "workdir: {tmp}/a_file is an existing file"),
    ],
)
def test_a_missing_input_is_one_line_that_names_it_exit_2(name, args, message, tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    out = run_job(name, *[a.format(tmp=tmp_path) for a in args])
    assert_one_line_exit_2(out, name, message.format(tmp=tmp_path))
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize("name", JOBS)
def test_an_unknown_flag_is_one_line_with_a_pointer_to_help(name):
    out = run_job(name, "--no-such-flag", "1")
    assert_one_line_exit_2(out, name, "unrecognized arguments: --no-such-flag 1")
    assert f"run {name} --help" in error_lines(out, name)[0]


@pytest.mark.parametrize("lrs", [["--lrs", "-0.1,0.01"], ["--lrs=-0.1,0.01"]])
def test_a_negative_value_reaches_its_fields_check(lrs):
    # argparse alone reads "-0.1,0.01" as a flag and says "expected one argument".
    out = run_job("finetune", "--train", "/a", "--test", "/b", *lrs)
    assert_one_line_exit_2(out, "finetune", "lrs: every learning rate must be positive, got [-0.1, 0.01]")


@pytest.fixture(scope="module")
def tiny_shards(tmp_path_factory, mlflow_store):
    """A real shard set of 16 photo crops in two classes: enough for pretrain's and finetune's checks."""
    from common.photos import photo
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    root = tmp_path_factory.mktemp("tiny")
    for cls, name in (("cat", "chelsea.png"), ("coffee", "coffee.png")):
        (root / "src" / cls).mkdir(parents=True)
        img = photo(name)
        for i in range(8):
            img.crop((i * 20, i * 10, i * 20 + 200, i * 10 + 200)).save(root / "src" / cls / f"{i}.png")
    run_prepare(PrepareConfig(input=[str(root / "src")], output=str(root / "shards"), size=32, workers=1))
    return root / "shards"


@pytest.mark.parametrize("name", ["pretrain", "finetune"])
def test_an_output_that_is_a_file_is_one_line_exit_2(name, tiny_shards, tmp_path):
    output = tmp_path / "model_out"
    output.write_text("an existing file")
    data = ["--data", str(tiny_shards), "--batch-size", "4", "--num-workers", "1"] if name == "pretrain" else \
        ["--train", str(tiny_shards), "--test", str(tiny_shards)]
    out = run_job(name, *data, "--output", str(output))
    assert_one_line_exit_2(out, name, f"output: {output} is an existing file; give a directory")
    assert output.read_text() == "an existing file"


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

