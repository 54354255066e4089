"""The MLflow UI seen the way a user sees it: real stages write a store, `server.sh local` serves
it on 127.0.0.1, and headless Chromium renders the pages the user opens.

The screenshots stay as test artifacts: the test prints the folder they are in.
"""
from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from common import tracking

REPO = Path(__file__).resolve().parents[2]
SERVER = REPO / "infra" / "mlflow" / "server.sh"


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.fail("Chromium is not installed, so the MLflow UI cannot be checked: run .ci/run, which "
                "apt-get installs chromium (or `apt-get install -y chromium`)")


def _render(url: str, tmp: Path, screenshot: Path | None = None, budget_ms: int = 20000) -> str:
    """The page's DOM after the single-page app loaded (Chromium's virtual time lets its
    requests and timers run first); with ``screenshot``, also a PNG of what the user sees."""
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--hide-scrollbars", f"--user-data-dir={tmp / 'chromium-profile'}",
            "--window-size=1400,1400", f"--virtual-time-budget={budget_ms}"]
    shot = [f"--screenshot={screenshot}"] if screenshot is not None else []
    dom = subprocess.run([*base, "--dump-dom", *shot, url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    if screenshot is not None:
        assert screenshot.exists() and screenshot.stat().st_size > 10_000, dom.stderr[-2000:]
    return dom.stdout


def _text(dom: str) -> str:
    """The visible text of a DOM dump, whitespace collapsed."""
    dom = re.sub(r"(?is)<(script|style)\b.*?</\1>", " ", dom)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"(?s)<[^>]+>", " ", dom)))


def _write_store(work: Path, env: dict[str, str]) -> None:
    """What real stages write: prepare over a dozen images, dedup against a test set that
    shares two of them (a contact sheet PNG), and a training run's params, step metrics and
    curve plot logged through common.tracking."""
    import numpy as np
    from PIL import Image
    from skimage import data as skdata

    corpus, test_set = work / "corpus", work / "test_set"
    corpus.mkdir()
    test_set.mkdir()
    photos = ["astronaut", "chelsea", "coffee", "rocket", "camera", "moon"]
    rng = np.random.default_rng(0)
    for i, name in enumerate(photos):
        img = Image.fromarray(getattr(skdata, name)()).convert("RGB").resize((96, 80))
        img.save(corpus / f"{name}.jpg")
        noise = Image.fromarray(rng.integers(0, 255, (72 + 4 * i, 88, 3), dtype=np.uint8))
        noise.save(corpus / f"noise_{i}.png")
    for name in photos[:2]:
        shutil.copy(corpus / f"{name}.jpg", test_set / f"{name}.jpg")

    def job(*args: str) -> None:
        out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, cwd=work)
        assert out.returncode == 0, f"{args}: {out.stderr[-3000:]}"

    job(str(REPO / "jobs" / "prepare.py"), "--input", str(corpus), "--output", str(work / "shards"),
        "--size", "64", "--workers", "1")
    job(str(REPO / "jobs" / "dedup.py"), "--shards", str(work / "shards"), "--test-set", f"mini={test_set}")
    job("-c", _TRAINING_RUN, str(work / "curves.png"))


# A training run as pretrain logs it: config params, per-step metrics, and the curves as a PNG.
_TRAINING_RUN = """
import sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from common import tracking

loss = [2.3 * 0.93 ** s for s in range(30)]
acc = [1 - l / 2.5 for l in loss]
with tracking.start_run("pretrain", params={"model": "Ti/16", "epochs": 2, "base_lr": 0.003, "batch_size": 32}):
    for step, (l, a) in enumerate(zip(loss, acc)):
        tracking.log_metrics({"train_loss": l, "val_accuracy": a}, step=step)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(loss, label="train_loss")
    ax.plot(acc, label="val_accuracy")
    ax.set_xlabel("step")
    ax.legend()
    fig.savefig(sys.argv[1], dpi=80)
    tracking.log_artifact(sys.argv[1], "plots")
"""


def test_the_ui_shows_every_stage_and_a_runs_params_metrics_and_plots(tmp_path, free_port, stop_process_group):
    _chromium()  # fail first, clearly, when the browser is missing
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"\nMLflow UI screenshots: {shots}")
    home = tmp_path / "mlruns"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "VITSCALE_"))}
    env.update(VITSCALE_HOME=str(home), PYTHONPATH=str(REPO), MLFLOW_BIN=str(Path(sys.executable).parent / "mlflow"))
    t0 = time.monotonic()
    _write_store(tmp_path, env)
    print(f"stages wrote the store in {time.monotonic() - t0:.0f}s")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(SERVER), "local", "--port", str(port)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:  # not listening yet, or busy starting
                pass
            assert time.monotonic() < deadline, f"server.sh local did not come up: {log.read_text()[-3000:]}"
            time.sleep(0.5)
        print(f"server up in {time.monotonic() - t0:.0f}s")

        exp = requests.get(url + "/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": "vitscale"},
                           timeout=10).json()["experiment"]
        runs = requests.post(url + "/api/2.0/mlflow/runs/search", json={"experiment_ids": [exp["experiment_id"]]},
                             timeout=10).json()["runs"]
        by_name = {r["info"]["run_name"]: r["info"]["run_id"] for r in runs}
        assert set(by_name) == {"prepare", "dedup", "pretrain"}, by_name

        # The experiment page a user is sent to (tracking.ui_url): the runs table, with a run of
        # every stage, not the GenAI overview.
        exp_id = exp["experiment_id"]
        page = _text(_render(tracking.ui_url(exp_id, url), tmp_path, shots / "experiment.png"))
        assert "Run Name" in page and "Model training" in page, page[:3000]
        for name in by_name:
            assert re.search(rf"\b{name}\b", page), f"run {name!r} not on the experiment page: {page[:3000]}"

        # The training run's page: its params and metrics...
        run_url = f"{url}/#/experiments/{exp_id}/runs/{by_name['pretrain']}"
        ml = "?workflowType=machine_learning"
        page = _text(_render(run_url + ml, tmp_path, shots / "pretrain-run.png"))
        for text in ("Parameters", "base_lr", "0.003", "batch_size", "Ti/16", "Metrics", "train_loss", "val_accuracy"):
            assert text in page, f"{text!r} not on the run page: {page[:3000]}"
        # ...and its plot, shown in the artifacts view.
        dom = _render(f"{run_url}/artifacts/plots/curves.png{ml}", tmp_path, shots / "pretrain-plot.png")
        assert "plots/curves.png" in _text(dom) and re.search(r"<img[^>]+curves\.png", dom), _text(dom)[:3000]

        # The dedup run shows its contact sheet of the test-set matches.
        dom = _render(f"{url}/#/experiments/{exp_id}/runs/{by_name['dedup']}/artifacts/dedup_report/contact_sheet.png{ml}",
                      tmp_path, shots / "dedup-contact-sheet.png")
        assert "dedup_summary.json" in _text(dom) and re.search(r"<img[^>]+contact_sheet\.png", dom), _text(dom)[:3000]
        print(f"four pages rendered and checked by {time.monotonic() - t0:.0f}s")
    finally:
        stop_process_group(proc)
