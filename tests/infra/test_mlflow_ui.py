"""The MLflow UI seen the way a user sees it: the demo's stages (the test session's ``small_demo``) and a
dedup with matches write a store, `server.sh local` serves it on 127.0.0.1, and headless Chromium
renders the pages the user opens.

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


def _write_dedup_runs(work: Path, env: dict[str, str]) -> None:
    """A prepare over a dozen images and a dedup against a test set that shares two of them, so
    that the dedup run has a contact sheet of its matches (the demo's dedup finds nothing new)."""
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


STAGES = ("prepare", "dedup", "pretrain", "finetune", "vtab", "fewshot", "demo")


def test_the_ui_shows_every_stage_and_a_runs_params_metrics_and_plots(small_demo, tmp_path, free_port,
                                                                      stop_process_group):
    _chromium()  # fail first, clearly, when the browser is missing
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"\nMLflow UI screenshots: {shots}")
    # A copy of the demo's store (its runs' artifacts stay where the demo wrote them), plus a
    # dedup that finds matches, in experiments of their own (prefix "ui") so that their artifacts
    # land in this test's folder.
    home = tmp_path / "mlruns"
    home.mkdir()
    shutil.copy(small_demo["home"] / "mlflow.db", home / "mlflow.db")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "VITSCALE_"))}
    env.update(VITSCALE_HOME=str(home), PYTHONPATH=str(REPO), MLFLOW_BIN=str(Path(sys.executable).parent / "mlflow"))
    t0 = time.monotonic()
    _write_dedup_runs(tmp_path, {**env, "VITSCALE_EXPERIMENT_PREFIX": "ui"})
    print(f"prepare and dedup wrote their runs in {time.monotonic() - t0:.0f}s")

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

        def experiment(name: str) -> tuple[str, dict[str, str]]:
            exp = requests.get(url + "/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": name},
                               timeout=10).json()["experiment"]
            runs = requests.post(url + "/api/2.0/mlflow/runs/search",
                                 json={"experiment_ids": [exp["experiment_id"]], "max_results": 1000},
                                 timeout=10).json()["runs"]
            top = {r["info"]["run_name"]: r["info"]["run_id"] for r in runs
                   if not any(t["key"] == "mlflow.parentRunId" for t in r["data"].get("tags", []))}
            return exp["experiment_id"], top

        # Each stage's experiment page, as a user is sent to it (tracking.ui_url): the runs table
        # of that stage only, every top-level run listed by its readable name.
        ids, runs = {}, {}
        for stage in STAGES:
            ids[stage], runs[stage] = experiment(f"vitscale-{stage}")
            assert runs[stage], stage
            page = _text(_render(tracking.ui_url(ids[stage], url), tmp_path, shots / f"experiment-{stage}.png"))
            assert "Run Name" in page and "Model training" in page, page[:3000]
            for name in runs[stage]:
                # The table cuts long names with an ellipsis; the first 20 characters show.
                assert name[:20] in page, f"{stage}: run {name!r} not on the experiment page: {page[:3000]}"
        assert len(runs["prepare"]) == 12 and "corpus (" in _text(_render(  # the Dataset column: name (digest)
            tracking.ui_url(ids["pretrain"], url), tmp_path))

        ml = "?workflowType=machine_learning"
        ((pre_name, pre_id),) = runs["pretrain"].items()
        run_url = f"{url}/#/experiments/{ids['pretrain']}/runs/{pre_id}"
        page = _text(_render(run_url + ml, tmp_path, shots / "pretrain-run.png"))
        for text in ("Parameters", "variant", "Ti/8", "batch_size", "Metrics", "train_loss", "images_per_second",
                     "vitscale.stage", "vitscale.config_hash", "corpus"):
            assert text in page, f"{text!r} not on the run page: {page[:3000]}"
        # ...and its plots, shown in the artifacts view.
        dom = _render(f"{run_url}/artifacts/plots/pretrain_curves.png{ml}", tmp_path, shots / "pretrain-curves.png")
        assert "plots/pretrain_curves.png" in _text(dom) and re.search(r"<img[^>]+pretrain_curves\.png", dom), \
            _text(dom)[:3000]
        ((_, fine_id),) = runs["finetune"].items()
        dom = _render(f"{url}/#/experiments/{ids['finetune']}/runs/{fine_id}/artifacts/plots/finetune_grid.png{ml}",
                      tmp_path, shots / "finetune-grid.png")
        assert re.search(r"<img[^>]+finetune_grid\.png", dom), _text(dom)[:3000]

        # The dedup run shows its contact sheet of the test-set matches.
        dedup_exp, dedup_runs = experiment("ui-dedup")
        ((_, dedup_id),) = dedup_runs.items()
        dom = _render(f"{url}/#/experiments/{dedup_exp}/runs/{dedup_id}/artifacts/dedup_report/contact_sheet.png{ml}",
                      tmp_path, shots / "dedup-contact-sheet.png")
        assert "dedup_summary.json" in _text(dom) and re.search(r"<img[^>]+contact_sheet\.png", dom), _text(dom)[:3000]
        print(f"pages rendered and checked by {time.monotonic() - t0:.0f}s")
    finally:
        stop_process_group(proc)
