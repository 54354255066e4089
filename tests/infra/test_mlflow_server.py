"""The shared MLflow server for real: ``infra/mlflow/server.sh remote`` on a real Postgres, basic auth on.

Postgres is Debian's (``.ci/run`` installs it), started here in a temporary directory on
127.0.0.1 and stopped at the end. A real job (``jobs/prepare.py``) logs through the server with
credentials from the environment; a request without them is refused; what it logged reads back
through the REST API, and lives in Postgres.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
SERVER = REPO / "infra" / "mlflow" / "server.sh"
# URL-reserved characters on purpose: server.sh must quote them into the URI and the auth ini.
DB_USER, DB_PASSWORD, DB_NAME = "vitscale", "p@ss:w/rd%1", "mlflow"
ADMIN, ADMIN_PASSWORD = "admin", "admin-Pa55word!"


def _pg_bindir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if not found and shutil.which("initdb"):
        found = [shutil.which("initdb")]
    if not found:
        pytest.fail("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): run .ci/run, "
                    "which apt-get installs postgresql, or `apt-get install -y postgresql`")
    return Path(found[-1]).parent


def _as_postgres(cmd: list[str]) -> list[str]:
    # initdb and postgres refuse to run as root; under root, run them as Debian's postgres user.
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture
def postgres(free_port):
    """A real Postgres server on 127.0.0.1 with a password-protected role and an empty database."""
    bindir = _pg_bindir()
    root = Path(tempfile.mkdtemp(prefix="vitscale-pg-"))  # not pytest's tmp: postgres must reach it
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
    (root / "pwfile").write_text(DB_PASSWORD + "\n")
    if os.geteuid() == 0:
        os.chown(root / "pwfile", pw.pw_uid, pw.pw_gid)
    data, port = root / "data", free_port()
    started = False
    try:
        subprocess.run(_as_postgres([str(bindir / "initdb"), "-D", str(data), "-U", DB_USER, "-A", "scram-sha-256",
                                     f"--pwfile={root / 'pwfile'}", "--no-sync"]),
                       check=True, capture_output=True, text=True)
        subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w",
                                     "-o", f"-c listen_addresses=127.0.0.1 -p {port} -k {root}", "start"]),
                       check=True, capture_output=True, text=True)
        started = True
        env = {**os.environ, "PGPASSWORD": DB_PASSWORD}
        subprocess.run([str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", DB_USER, DB_NAME],
                       check=True, capture_output=True, text=True, env=env)
        yield {"host": "127.0.0.1", "port": port}
    except subprocess.CalledProcessError as exc:
        log = (root / "log").read_text()[-2000:] if (root / "log").exists() else ""
        pytest.fail(f"Postgres did not start: {exc.cmd}: {exc.stderr}{log}")
    finally:
        if started:
            subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]),
                           capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def _wait_up(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server.sh remote exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:  # not listening yet, or busy starting
            pass
        time.sleep(0.5)
    pytest.fail(f"server.sh remote did not answer /health in {timeout:.0f}s: {log.read_text()[-3000:]}")


def test_remote_server_on_postgres_with_basic_auth(postgres, tmp_path, free_port, stop_process_group,
                                                   tcp_listeners, loopback_addresses):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_env = {
        **os.environ,
        "MLFLOW_BIN": str(Path(sys.executable).parent / "mlflow"),
        "MLFLOW_DB_HOST": postgres["host"], "MLFLOW_DB_PORT": str(postgres["port"]),
        "MLFLOW_DB_NAME": DB_NAME, "MLFLOW_DB_USER": DB_USER, "MLFLOW_DB_PASSWORD": DB_PASSWORD,
        "MLFLOW_ARTIFACTS_DESTINATION": str(tmp_path / "artifacts"),
        "MLFLOW_PORT": str(port), "MLFLOW_WORKERS": "1",
        "MLFLOW_AUTH": "basic", "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN_PASSWORD,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-secret-key-shared-by-workers",
    }
    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_AUTH_CONFIG_PATH"):
        server_env.pop(k, None)

    dry = subprocess.run([str(SERVER), "remote", "--dry-run"], env=server_env, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert "--app-name basic-auth" in dry.stdout and DB_PASSWORD not in dry.stdout and "***@127.0.0.1" in dry.stdout

    log = tmp_path / "server.log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(SERVER), "remote"], env=server_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_up(url, proc, log)
        print(f"\nserver.sh remote up on Postgres in {time.monotonic() - t0:.0f}s")
        if tcp_listeners is not None:
            listening = tcp_listeners(proc.pid)
            assert listening and {a for a, _ in listening} <= loopback_addresses, listening

        search = url + "/api/2.0/mlflow/experiments/search"
        assert requests.post(search, json={"max_results": 10}, timeout=10).status_code == 401
        assert requests.post(search, json={"max_results": 10}, auth=(ADMIN, "wrong"), timeout=10).status_code == 401

        # A real job, in its own process, with only the tracking URI and credentials to go on.
        corpus = tmp_path / "corpus"
        corpus.mkdir()
        from PIL import Image
        from skimage import data as skdata

        for i, name in enumerate(["astronaut", "chelsea", "coffee", "rocket"]):
            Image.fromarray(getattr(skdata, name)()).resize((96 + 8 * i, 80)).save(corpus / f"{name}.jpg")
        job_env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "VITSCALE_"))}
        job_env.update(MLFLOW_TRACKING_URI=url, MLFLOW_TRACKING_USERNAME=ADMIN, MLFLOW_TRACKING_PASSWORD=ADMIN_PASSWORD,
                       PYTHONPATH=str(REPO), VITSCALE_HOME=str(tmp_path / "unused-local-store"))
        job = subprocess.run([sys.executable, str(REPO / "jobs" / "prepare.py"), "--input", str(corpus),
                              "--output", str(tmp_path / "shards"), "--size", "64", "--workers", "1"],
                             env=job_env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert job.returncode == 0, job.stderr[-3000:]
        assert not (tmp_path / "unused-local-store").exists()  # it logged to the server, not a local store
        print(f"prepare logged through it by {time.monotonic() - t0:.0f}s")

        # The same job without credentials is refused by the server: it fails, and logs nothing.
        anon_env = {k: v for k, v in job_env.items() if not k.startswith("MLFLOW_TRACKING_")}
        anon_env["MLFLOW_TRACKING_URI"] = url
        anon = subprocess.run([sys.executable, "-c", "from common import tracking\n"
                               "with tracking.start_run('intruder'): pass"],
                              env=anon_env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert anon.returncode != 0 and "401" in anon.stderr + anon.stdout, anon.stderr[-2000:]

        auth = (ADMIN, ADMIN_PASSWORD)
        exps = requests.post(search, json={"max_results": 100}, auth=auth, timeout=10)
        assert exps.status_code == 200, exps.text
        exp = next(e for e in exps.json()["experiments"] if e["name"] == "vitscale-prepare")
        assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in exp["tags"]
        runs = requests.post(url + "/api/2.0/mlflow/runs/search", json={"experiment_ids": [exp["experiment_id"]]},
                             auth=auth, timeout=10).json()["runs"]
        assert [r["info"]["run_name"] for r in runs] == ["prepare shards"]
        run_id = runs[0]["info"]["run_id"]
        got = requests.get(url + "/api/2.0/mlflow/runs/get", params={"run_id": run_id}, auth=auth, timeout=10)
        assert got.status_code == 200
        run = got.json()["run"]
        assert run["info"]["status"] == "FINISHED"
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        assert params["size"] == "64" and params["output"] == str(tmp_path / "shards"), params
        metrics = {m["key"]: m["value"] for m in run["data"].get("metrics", [])}
        assert metrics, "the prepare run logged no metrics"
        assert any(v == 4 for v in metrics.values()), metrics  # the four input images are counted
        key = next(iter(metrics))
        hist = requests.get(url + "/api/2.0/mlflow/metrics/get-history", params={"run_id": run_id, "metric_key": key},
                            auth=auth, timeout=10)
        assert hist.status_code == 200 and hist.json()["metrics"][0]["value"] == metrics[key]
        assert requests.get(url + "/api/2.0/mlflow/runs/get", params={"run_id": run_id}, timeout=10).status_code == 401

        # The runs and the users really live in Postgres.
        import psycopg2

        with psycopg2.connect(host=postgres["host"], port=postgres["port"], user=DB_USER, password=DB_PASSWORD,
                              dbname=DB_NAME) as conn, conn.cursor() as cur:
            cur.execute("SELECT run_uuid, name FROM runs")
            assert cur.fetchall() == [(run_id, "prepare shards")]
            cur.execute("SELECT username FROM users")
            assert [u for (u,) in cur.fetchall()] == [ADMIN]
    finally:
        stop_process_group(proc)
