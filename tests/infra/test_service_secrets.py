"""Secrets the service scripts create stay with their owner and do not outlive the service."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "infra" / "ray" / "local-cluster.sh"
SERVER = REPO / "infra" / "mlflow" / "server.sh"
BIN = Path(sys.executable).parent


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _cluster_env(home: Path) -> dict:
    env = dict(os.environ, HOME=str(home), VIRTUAL_ENV=str(BIN.parent))
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    return env


def test_the_ray_token_is_created_readable_by_its_owner_only(tmp_path):
    out = subprocess.run([str(CLUSTER), "token"], env=_cluster_env(tmp_path), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    token = tmp_path / ".ray" / "auth_token"
    assert out.stdout.strip() == str(token)
    assert len(token.read_text().strip()) >= 32
    assert _mode(token) == 0o600 and _mode(token.parent) == 0o700


def test_a_world_readable_ray_token_is_tightened_and_kept(tmp_path):
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir(mode=0o755)
    token.write_text("an-existing-token")
    token.chmod(0o644)
    out = subprocess.run([str(CLUSTER), "token"], env=_cluster_env(tmp_path), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert _mode(token) == 0o600 and token.read_text() == "an-existing-token"


def _auth_env(tmp_path: Path) -> dict:
    env = dict(os.environ, VITSCALE_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"),
               MLFLOW_BIN=str(BIN / "mlflow"), MLFLOW_AUTH="basic", MLFLOW_AUTH_ADMIN_PASSWORD="adm-pass-1234",
               MLFLOW_FLASK_SERVER_SECRET_KEY="a-secret-key")
    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_AUTH_CONFIG_PATH"):
        env.pop(k, None)
    (tmp_path / "tmp").mkdir()
    return env


def test_a_dry_run_with_basic_auth_writes_no_auth_ini(tmp_path):
    env = _auth_env(tmp_path)
    out = subprocess.run([str(SERVER), "local", "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--app-name basic-auth" in out.stdout
    assert list((tmp_path / "tmp").rglob("*")) == []


def test_the_auth_ini_with_the_database_uri_is_private_and_removed_when_the_server_stops(
        tmp_path, free_port, stop_process_group):
    env, port = _auth_env(tmp_path), free_port()
    proc = subprocess.Popen([str(SERVER), "local", "--port", str(port)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail("server.sh local did not come up: "
                                + (proc.stdout.read()[-3000:] if proc.poll() is not None else "timeout"))
                time.sleep(0.5)
        (ini,) = (tmp_path / "tmp").rglob("basic_auth.ini")
        assert "database_uri" in ini.read_text()
        assert _mode(ini.parent) == 0o700
    finally:
        # TERM to the script alone, as a container runtime sends it to PID 1: the server
        # must stop with it, and the ini must go.
        proc.terminate()
        try:
            proc.wait(timeout=60)
        finally:
            stop_process_group(proc)
    assert list((tmp_path / "tmp").rglob("*")) == []
