"""The comparison report (jobs/report.py) on the runs the demo's stages logged to a real MLflow store."""
from __future__ import annotations

import base64
import html
import io
import os
import re
import subprocess
import sys

import mlflow
import numpy as np
import pytest
from PIL import Image

from common import tracking
from reports.report import ReportConfig, run_report

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECTIONS = ("summary", "pretraining", "finetuning", "vtab", "fewshot", "dedup", "lineage")


@pytest.fixture
def store(small_demo, monkeypatch):
    """The demo's store as the default one, as a user who ran the demo and then the report has it."""
    monkeypatch.setenv("VITSCALE_HOME", str(small_demo["home"]))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("VITSCALE_PARENT_RUN_ID", raising=False)
    return mlflow.MlflowClient(tracking.tracking_uri())


def section(page: str, name: str) -> str:
    m = re.search(rf'<section id="{name}">(.*?)</section>', page, re.S)
    assert m, f"section {name} missing"
    return m.group(1)


def pngs(fragment: str) -> list[Image.Image]:
    out = []
    for data in re.findall(r'src="data:image/png;base64,([^"]+)"', fragment):
        raw = base64.b64decode(data)
        image = Image.open(io.BytesIO(raw))
        image.load()
        assert image.format == "PNG"
        out.append(image)
    return out


def assert_real_plot(image: Image.Image) -> None:
    w, h = image.size
    assert w >= 400 and h >= 250, image.size
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    assert pixels.std() > 10, "the plot is blank"
    # Axes, text and at least one coloured series: far more than a couple of colours.
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50


def stage_runs(client, stage: str) -> list:
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps, filter_string=f"tags.`vitscale.stage` = '{stage}'")


def prepare_ids(client, work) -> dict[str, str]:
    """The demo's prepare runs by the shard set they wrote (corpus, digits-train, digits-test)."""
    return {os.path.basename(r.data.params["output"]): r.info.run_id for r in stage_runs(client, "prepare")
            if os.path.dirname(r.data.params["output"]) == str(work / "shards")}


def test_the_demo_ends_with_a_report_of_every_section(small_demo, store):
    s = small_demo["summary"]
    prepared = prepare_ids(store, small_demo["work"])
    page = open(s["report"], encoding="utf-8").read()
    for name in SECTIONS:
        section(page, name)
    # Self-contained: nothing fetched, nothing run.
    assert "<script" not in page and "<link" not in page and not re.search(r'src="(?!data:)', page)

    pre = section(page, "pretraining")
    [curves] = pngs(pre)
    assert_real_plot(curves)
    assert s["pretrain"]["mlflow_run_id"][:8] in pre

    fine = section(page, "finetuning")
    [by_lr] = pngs(fine)
    assert_real_plot(by_lr)
    text = html.unescape(re.sub(r"<[^>]+>", " ", fine))
    for trial in s["finetune"]["trials"]:
        assert f"{trial['lr']:g}" in text and f"{trial['val_accuracy']:.3f}" in text
    assert f"at lr {s['finetune']['selected_lr']:g}: test accuracy {s['finetune']['test_accuracy']:.3f}" in text
    assert fine.count('class="sel"') == 1  # the selected rate's row

    vtab = section(page, "vtab")
    [bars] = pngs(vtab)
    assert_real_plot(bars)
    text = re.sub(r"<[^>]+>", " ", vtab)
    for task, r in s["vtab"]["tasks"].items():
        assert task in text and f"{r['test_accuracy']:.3f}" in text
    for group, mean in s["vtab"]["groups"].items():
        assert f"{group} mean" in text and f"{mean:.3f}" in text
    assert f"{s['vtab']['mean']:.3f}" in text

    dedup = section(page, "dedup")
    [removed] = pngs(dedup)
    assert_real_plot(removed)
    row = next(r for r in re.findall(r"<tr>(.*?)</tr>", dedup, re.S) if prepared["corpus"][:8] in r)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    assert cells[-1] == str(s["prepare"]["corpus"]["duplicates"]["digits_test"]) == str(s["data"]["planted"])

    # The fine-tuned model's lineage: the pretrain run, and the prepare runs of the corpus and of digits.
    lineage = section(page, "lineage")
    fine_row = next(r for r in re.findall(r"<tr>(.*?)</tr>", lineage, re.S)
                    if r.startswith(f'<td title="{s["finetune"]["mlflow_run_id"]}'))
    assert s["pretrain"]["mlflow_run_id"][:8] in fine_row
    assert {"corpus", "digits-train", "digits-test"} <= set(prepared)
    for run_id in prepared.values():
        assert run_id[:8] in fine_row


def test_the_report_is_logged_as_a_report_run(small_demo, store, tmp_path):
    out = tmp_path / "r.html"
    r = run_report(ReportConfig(output=str(out)))
    run = store.get_run(r["mlflow_run_id"])
    assert run.data.tags["vitscale.stage"] == "report"
    assert run.info.status == "FINISHED"
    names = {a.path for a in store.list_artifacts(run.info.run_id)}
    assert "report.html" in names
    plots = {a.path for a in store.list_artifacts(run.info.run_id, "plots")}
    assert "plots/pretrain_curves.png" in plots and "plots/vtab.png" in plots
    local = store.download_artifacts(run.info.run_id, "report.html", str(tmp_path / "dl"))
    assert open(local, "rb").read() == out.read_bytes()
    # The report run itself is never reported on.
    again = run_report(ReportConfig(output=str(tmp_path / "again.html")))
    assert again["runs"] == r["runs"]
    # The demo logged its own report run, tagged with the demo run.
    demo = [x for x in stage_runs(store, "report") if x.data.tags.get("vitscale.demo_run_id") == small_demo["summary"]["mlflow_run_id"]]
    assert len(demo) == 1


def test_selection_by_run_id_and_by_experiment(small_demo, store, tmp_path):
    s = small_demo["summary"]
    out = tmp_path / "one.html"
    r = run_report(ReportConfig(output=str(out), run_id=[s["finetune"]["mlflow_run_id"]]))
    assert r["runs"] == 1 and r["stages"]["finetune"] == 1
    page = out.read_text()
    assert "No pre-training runs in the selection" in page and "No VTAB runs in the selection" in page
    assert s["finetune"]["mlflow_run_id"][:8] in section(page, "finetuning")
    # Lineage still names what fed the selected run, though those runs are not reported on.
    assert s["pretrain"]["mlflow_run_id"][:8] in section(page, "lineage")

    # An experiment: exactly its stage runs (one experiment for all, or one per stage, alike).
    pretrain = store.get_run(s["pretrain"]["mlflow_run_id"])
    name = store.get_experiment(pretrain.info.experiment_id).name
    r = run_report(ReportConfig(output=str(tmp_path / "exp.html"), experiment=[name]))
    expected = {}
    for stage in ("prepare", "dedup", "pretrain", "finetune", "vtab", "fewshot"):
        expected[stage] = sum(x.info.experiment_id == pretrain.info.experiment_id for x in stage_runs(store, stage))
    assert r["stages"] == expected and expected["pretrain"] >= 1


def _job(args: list[str], home) -> subprocess.CompletedProcess:
    env = {**os.environ, "VITSCALE_HOME": str(home), "PYTHONPATH": REPO}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([sys.executable, os.path.join(REPO, "jobs", "report.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_job_writes_the_report_and_names_the_best_run(small_demo, tmp_path):
    out = tmp_path / "job.html"
    p = _job(["--output", str(out)], small_demo["home"])
    assert p.returncode == 0, p.stderr
    assert out.is_file() and out.stat().st_size > 50_000
    assert f"report: {out}" in p.stdout
    assert "finetune on digits-train:" in p.stdout


@pytest.mark.parametrize("case", ["unknown experiment", "unknown run", "no store", "store without runs",
                                  "missing folder", "a directory"])
def test_bad_input_is_one_line_and_exit_2(small_demo, tmp_path, case):
    home, args, expect = small_demo["home"], ["--output", str(tmp_path / "r.html")], ""
    if case == "unknown experiment":
        args += ["--experiment", "no-such-experiment"]
        expect = "no experiment named 'no-such-experiment'"
    elif case == "unknown run":
        args += ["--run-id", "0123456789abcdef0123456789abcdef"]
        expect = "is not a vitscale run"
    elif case == "no store":
        home = tmp_path / "empty"
        expect = "does not exist; run a stage first"
    elif case == "store without runs":
        home = tmp_path / "empty"
        home.mkdir()
        mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}").search_experiments()  # creates the tables
        expect = "holds no prepare, dedup, pretrain, finetune, vtab, fewshot runs"
    elif case == "missing folder":
        args = ["--output", str(tmp_path / "nope" / "r.html")]
        expect = "does not exist; create it"
    else:
        args = ["--output", str(tmp_path)]
        expect = "is a directory"
    p = _job(args, home)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("report: error:") and expect in lines[0], p.stderr
    assert not (tmp_path / "r.html").exists()
