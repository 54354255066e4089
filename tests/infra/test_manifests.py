"""infra/ stays deployable: manifests parse, name real jobs and flags, and the install order holds.

Nothing here needs a cloud, a Kubernetes cluster or a Docker engine: the checks are the ones
that catch drift between infra/ and the code (a renamed flag, a moved job, a dropped pin).
"""
from __future__ import annotations

import copy
import functools
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
YAML_FILES = sorted(p for p in INFRA.rglob("*") if p.suffix in (".yaml", ".yml"))
SHELL_SCRIPTS = sorted(INFRA.rglob("*.sh"))


def _docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _objects(kind: str) -> list[tuple[Path, dict]]:
    return [(p, d) for p in YAML_FILES for d in _docs(p) if isinstance(d, dict) and d.get("kind") == kind]


@functools.lru_cache(maxsize=None)
def _job_flags(job: str) -> frozenset[str]:
    """Every --flag that ``jobs/<job>`` accepts, read from its own --help."""
    out = subprocess.run(
        [sys.executable, str(REPO / "jobs" / job), "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert out.returncode == 0, f"jobs/{job} --help failed:\n{out.stderr[-2000:]}"
    # The usage block only: the help prose mentions other jobs' flags too.
    usage = out.stdout.split("\n\n", 1)[0]
    assert usage.startswith("usage:"), out.stdout[:500]
    return frozenset(re.findall(r"\[(--[a-z][a-z0-9-]*)", usage))


def _entrypoint_job(entrypoint: str) -> tuple[str, list[str]]:
    """(jobs/X.py, its arguments) from ``python [/app/]jobs/X.py ...``."""
    argv = shlex.split(entrypoint)
    assert argv[0] in ("python", "python3"), f"entrypoint should start with python: {entrypoint!r}"
    m = re.fullmatch(r"(?:/app/)?jobs/(\w+\.py)", argv[1])
    assert m, f"entrypoint should run a jobs/*.py script (the image keeps the repo at /app): {argv[1]!r}"
    return m.group(1), argv[2:]


def _flags_in(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


RAYJOBS = _objects("RayJob")
RAYCLUSTERS = _objects("RayCluster")


def test_every_yaml_parses():
    assert YAML_FILES, "no YAML under infra/"
    for path in YAML_FILES:
        assert _docs(path), f"{path}: empty"


def test_our_kuberay_manifests_exist():
    names = {p.relative_to(INFRA).as_posix() for p, _ in RAYJOBS + RAYCLUSTERS}
    assert {"kuberay/raycluster.yaml", "kuberay/rayjob-pretrain.yaml", "kuberay/rayjob-finetune.yaml"} <= names


@pytest.mark.parametrize("path,obj", RAYJOBS + RAYCLUSTERS, ids=lambda v: v.name if isinstance(v, Path) else "")
def test_kuberay_objects_are_ray_io_v1(path, obj):
    assert obj["apiVersion"] == "ray.io/v1", path
    assert obj["metadata"]["name"], path


def _cluster_specs() -> list[tuple[str, dict]]:
    specs = [(f"{p.name}", o["spec"]) for p, o in RAYCLUSTERS]
    specs += [(f"{p.name}", o["spec"]["rayClusterSpec"]) for p, o in RAYJOBS if "rayClusterSpec" in o["spec"]]
    return specs


@pytest.mark.parametrize("name,spec", _cluster_specs(), ids=lambda v: v if isinstance(v, str) else "")
def test_cluster_specs_have_head_and_images(name, spec):
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict), name
    assert all(isinstance(v, str) for v in head["rayStartParams"].values()), f"{name}: rayStartParams values must be strings"
    pods = [head["template"]] + [g["template"] for g in spec.get("workerGroupSpecs", [])]
    for pod in pods:
        for c in pod["spec"]["containers"]:
            assert c["image"], f"{name}: container {c['name']} has no image"


@pytest.mark.parametrize("path", ["kuberay/raycluster.yaml", "kuberay/rayjob-pretrain.yaml", "kuberay/rayjob-finetune.yaml"])
def test_gpu_workers_get_gpus_shm_and_token_auth(path):
    (obj,) = _docs(INFRA / path)
    spec = obj["spec"] if obj["kind"] == "RayCluster" else obj["spec"]["rayClusterSpec"]
    assert spec["rayVersion"] == "2.60.0"
    assert spec["authOptions"]["mode"] == "token", "clusters are token-authenticated like `ray start --head`"
    (group,) = spec["workerGroupSpecs"]
    pod = group["template"]["spec"]
    (c,) = pod["containers"]
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    cpus = int(c["resources"]["limits"]["cpu"])
    assert gpus >= 1
    shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert shm and any(m["mountPath"] == "/dev/shm" and m["name"] == shm[0]["name"] for m in c["volumeMounts"]), \
        f"{path}: NCCL needs a memory-backed /dev/shm"
    # Shared storage on every pod: Ray Train state lives under --output.
    for p in [spec["headGroupSpec"]["template"]["spec"], pod]:
        claims = {v["persistentVolumeClaim"]["claimName"] for v in p["volumes"] if "persistentVolumeClaim" in v}
        assert claims == {"vitscale-data"}, path
    if obj["kind"] == "RayJob":
        _, args = _entrypoint_job(obj["spec"]["entrypoint"])
        flags = dict(zip(args, args[1:]))
        from_config = yaml.safe_load((REPO / flags["--config"][len("/app/"):]).read_text()) if "--config" in flags else {}
        per = int(flags.get("--cpus-per-worker", flags.get("--cpus-per-trial", from_config.get("cpus_per_worker", 1))))
        # One training worker (or trial) per GPU.
        assert gpus * per < cpus, f"{path}: training reserves every CPU of a node; Ray Data stalls"


@pytest.mark.parametrize("path,obj", RAYJOBS, ids=lambda v: v.name if isinstance(v, Path) else "")
def test_rayjob_fields(path, obj):
    spec = obj["spec"]
    assert spec["shutdownAfterJobFinishes"] is True, path
    assert isinstance(spec["ttlSecondsAfterFinished"], int) and spec["ttlSecondsAfterFinished"] >= 0, path
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert runtime_env["env_vars"]["MLFLOW_TRACKING_URI"].startswith("http"), f"{path}: jobs must log to the shared server"


@pytest.mark.parametrize("path,obj", RAYJOBS, ids=lambda v: v.name if isinstance(v, Path) else "")
def test_rayjob_entrypoint_runs_a_real_job_with_real_flags(path, obj):
    job, args = _entrypoint_job(obj["spec"]["entrypoint"])
    assert (REPO / "jobs" / job).is_file(), f"{path}: jobs/{job} does not exist"
    unknown = _flags_in(args) - _job_flags(job)
    assert not unknown, f"{path}: jobs/{job} does not accept {sorted(unknown)}"


def test_entrypoints_parse_into_valid_configs():
    """Beyond flag names: values must pass the job's own typed config (types, choices, checks)."""
    from common.config import parse_args
    from training.pretrain import PretrainConfig
    from transfer.finetune import FinetuneConfig

    configs = {"pretrain.py": PretrainConfig, "finetune.py": FinetuneConfig}
    checked = 0
    for path, obj in RAYJOBS:
        job, args = _entrypoint_job(obj["spec"]["entrypoint"])
        # The image keeps the repository at /app: read a --config from this checkout.
        args = [str(REPO / a[len("/app/"):]) if a.startswith("/app/configs/") else a for a in args]
        if job in configs:
            cfg = parse_args(configs[job], args, prog=job)
            checked += 1
            if job == "pretrain.py":
                assert cfg.use_gpu and cfg.output.startswith("/data/"), path
                # The worked B/16 i21k recipe (configs/pretrain-b16-i21k.yaml), one worker per GPU of 2x8.
                assert (cfg.variant, cfg.img_size, cfg.batch_size, cfg.lr, cfg.weight_decay, cfg.warmup_steps,
                        cfg.epochs, cfg.num_workers) == ("B/16", 224, 4096, 1e-3, 0.03, 10_000, 90, 16), path
            else:
                assert cfg.gpus_per_trial >= 1 and len(cfg.lrs) == 4, path
    assert checked == 2


def test_ray_cluster_yaml_passes_the_autoscaler_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((INFRA / "ray" / "cluster.yaml").read_text())
    cfg = prepare_config(copy.deepcopy(raw))
    validate_config(cfg)
    types = cfg["available_node_types"]
    assert types[cfg["head_node_type"]]["node_config"]["InstanceType"].startswith("m")
    gpu = [t for name, t in types.items() if name != cfg["head_node_type"]]
    assert gpu and gpu[0]["node_config"]["InstanceType"].startswith(("p", "g"))
    # prepare_config prepends setup_commands to the head/worker ones: the order a node runs.
    for key in ("head_setup_commands", "worker_setup_commands"):
        cmds = cfg[key]
        torch_at = next(i for i, c in enumerate(cmds) if "torch==2.13.0" in c)
        project_at = next(i for i, c in enumerate(cmds) if "-c ~/vitscale/constraints.txt -e ~/vitscale" in c)
        assert torch_at < project_at, f"{key}: torch must be installed before the project"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert any("RAY_AUTH_MODE=token" in c for c in cfg[key]), key
    assert "--dashboard-host=127.0.0.1" in " ".join(cfg["head_start_ray_commands"])


def _dockerfile_runs(path: Path) -> list[str]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_installs_torch_first_then_the_project_with_constraints():
    lines = _dockerfile_runs(INFRA / "docker" / "Dockerfile")
    assert lines[0].startswith("ARG PYTHON_IMAGE=python:3.11-slim")
    torch_at = next(i for i, l in enumerate(lines) if l.startswith("RUN") and "torch==2.13.0" in l)
    deps_at = next(i for i, l in enumerate(lines) if l.startswith("RUN") and "-c constraints.txt -r" in l)
    project_at = next(i for i, l in enumerate(lines) if l.startswith("RUN") and "pip install -c constraints.txt -e ." in l)
    assert torch_at < deps_at < project_at
    assert "--index-url \"${TORCH_INDEX_URL}\"" in lines[torch_at]
    assert not any("torchvision" in l for l in lines)
    copied = {tok for l in lines if l.startswith("COPY") for tok in l.split()[1:-1] if not tok.startswith("--")}
    for name in ("pyproject.toml", "constraints.txt", "README.md", "vitcore", "common", "pipelines", "dedup", "training", "transfer", "demo", "jobs"):
        assert name in copied and (REPO / name).exists(), name
    # Every package setuptools installs must be copied before `pip install -e .`.
    include = __import__("tomllib").loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in include} <= copied


def test_dockerignore_keeps_outputs_out_and_sources_in():
    patterns = [l.strip() for l in (INFRA / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
                if l.strip() and not l.startswith("#")]
    for excluded in (".venv", "mlruns", ".git"):
        assert excluded in patterns
    for needed in ("pyproject.toml", "constraints.txt", "README.md", "vitcore", "common", "pipelines", "dedup", "training", "transfer", "demo", "jobs", "infra"):
        assert needed not in patterns


def test_mlflow_image_pins_match_constraints():
    pins = dict(l.split("==") for l in (REPO / "constraints.txt").read_text().splitlines() if "==" in l)
    text = (INFRA / "mlflow" / "Dockerfile").read_text()
    assert f"mlflow[auth]=={pins['mlflow']}" in text


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.relative_to(INFRA).as_posix())
def test_shell_scripts_parse_and_are_executable(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert os.access(script, os.X_OK), f"{script}: chmod +x"


def test_local_cluster_script_rejects_bad_input_clearly(tmp_path):
    script = INFRA / "ray" / "local-cluster.sh"
    out = subprocess.run([str(script), "stop", "--temp-dir", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 2 and "no cluster started from" in out.stderr
    out = subprocess.run([str(script), "start", "--num-cpus", "many"], capture_output=True, text=True)
    assert out.returncode == 2 and "--num-cpus must be a whole number" in out.stderr


def test_docker_compose_wires_mlflow_to_postgres_and_minio():
    compose = yaml.safe_load((INFRA / "mlflow" / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "minio", "mlflow"} <= set(services)
    mlflow = services["mlflow"]
    assert mlflow["ports"] == ["127.0.0.1:5000:5000"], "publish on loopback only"
    env = mlflow["environment"]
    assert env["MLFLOW_DB_HOST"] == "postgres" and env["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert "postgres" in mlflow["depends_on"]
    for name in ("postgres", "minio"):
        assert "ports" not in services[name], f"{name} must stay on the compose network"
    assert (INFRA / "mlflow" / mlflow["build"] / "Dockerfile").is_file()


def test_mlflow_k8s_service_reaches_the_deployment_and_secrets_are_documented():
    docs = {d["kind"]: d for d in _docs(INFRA / "mlflow" / "k8s.yaml")}
    dep, svc = docs["Deployment"], docs["Service"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
    (sp,) = svc["spec"]["ports"]
    assert sp["targetPort"] in port_names and sp["port"] == 5000
    # The URI every in-cluster job uses.
    assert f"http://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:{sp['port']}" == "http://mlflow.vitscale.svc:5000"
    env = {e["name"]: e for e in c["env"]}
    assert env["MLFLOW_HOST"]["value"] == "0.0.0.0"
    readme = (INFRA / "README.md").read_text()
    refs = {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs
    for name, key in refs:
        assert f"kubectl create secret generic {name}" in readme, f"README must show how to create Secret {name}"
        assert f"--from-literal={key}=" in readme, f"README must set key {key} of Secret {name}"


def test_readme_links_every_infra_directory():
    readme = (INFRA / "README.md").read_text()
    for sub in ("ray/", "kuberay/", "mlflow/", "docker/", "beam/", "dedup/"):
        assert f"]({sub}" in readme, f"infra/README.md does not link {sub}"


def test_mlflow_server_script_local_mode_serves_the_jobs_store(tmp_path, free_port, stop_process_group):
    """server.sh local: bound to loopback, and what a job logs through it lands in $VITSCALE_HOME."""
    home, port = tmp_path / "home", free_port()
    env = dict(os.environ, VITSCALE_HOME=str(home), MLFLOW_BIN=str(Path(sys.executable).parent / "mlflow"))
    env.pop("MLFLOW_TRACKING_URI", None)
    dry = subprocess.run([str(INFRA / "mlflow" / "server.sh"), "local", "--port", str(port), "--dry-run"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert f"--backend-store-uri sqlite:///{home}/mlflow.db" in dry and "--host 127.0.0.1" in dry
    proc = subprocess.Popen([str(INFRA / "mlflow" / "server.sh"), "local", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"server.sh local did not come up: {proc.stdout.read()[-3000:] if proc.poll() is not None else 'timeout'}")
                time.sleep(0.5)
        # MLflow's GenAI job runner stays off: no job runner or queue consumers in the server's group.
        group = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and os.getpgid(int(entry)) == proc.pid:
                    group.append(Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                continue
        assert group and not [c for c in group if "huey" in c or "jobs._job_runner" in c], group
        client = subprocess.run(
            [sys.executable, "-c",
             "from common import tracking\n"
             "with tracking.start_run('infra-check', params={'x': 1}) as run:\n"
             "    tracking.log_metrics({'m': 2.0})\n"
             "print(run.info.run_id)"],
            cwd=REPO, env=dict(env, MLFLOW_TRACKING_URI=f"http://127.0.0.1:{port}", PYTHONPATH=str(REPO)),
            capture_output=True, text=True, timeout=120,
        )
        assert client.returncode == 0, client.stderr[-3000:]
        run_id = client.stdout.strip().splitlines()[-1]
    finally:
        stop_process_group(proc)
    import mlflow

    run = mlflow.MlflowClient(f"sqlite:///{home}/mlflow.db").get_run(run_id)
    assert run.data.metrics["m"] == 2.0 and run.data.params["x"] == "1"


def test_mlflow_server_script_remote_mode_names_missing_settings():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AWS_"))}
    out = subprocess.run([str(INFRA / "mlflow" / "server.sh"), "remote", "--dry-run"], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "MLFLOW_DB_HOST" in out.stderr
    env.update(MLFLOW_DB_HOST="db", MLFLOW_DB_NAME="mlflow", MLFLOW_DB_USER="u", MLFLOW_DB_PASSWORD="p@ss/word",
               MLFLOW_ARTIFACTS_DESTINATION="s3://bucket/mlflow", MLFLOW_AUTH="basic")
    out = subprocess.run([str(INFRA / "mlflow" / "server.sh"), "remote", "--dry-run"], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "MLFLOW_AUTH_ADMIN_PASSWORD" in out.stderr
    env.update(MLFLOW_AUTH_ADMIN_PASSWORD="a-long-admin-password", MLFLOW_FLASK_SERVER_SECRET_KEY="k", AWS_ACCESS_KEY_ID="x")
    out = subprocess.run([str(INFRA / "mlflow" / "server.sh"), "remote", "--dry-run"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "postgresql+psycopg2://u:***@db:5432/mlflow" in out.stdout and "p@ss" not in out.stdout
    assert "--app-name basic-auth" in out.stdout and "--host 127.0.0.1" in out.stdout
