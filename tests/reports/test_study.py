"""A study's Figures 4 and 5, drawn from a hand-made table (no training)."""
from __future__ import annotations

import io
import re
import time

import mlflow
import numpy as np
from PIL import Image

from common import plots, tracking
from reports import compare, html, study
from reports.report import ReportConfig, run_report
from reports.store import open_store


def section(page: str, name: str) -> str:
    m = re.search(rf'<section id="{name}">(.*?)</section>', page, re.S)
    assert m, f"section {name} missing"
    return m.group(1)

# Two models (a ViT and a BiT ResNet) at three fractions, 5- and 10-shot; one cell unscored.
ROWS = [
    {"model": m, "fraction": f, "images": int(800 * f), "steps": int(100 * f), "exaflops": x * f,
     "best_step": 10, "mlflow_run_id": "r", "5shot_accuracy": a * f ** 0.2, "5shot_step": 10,
     "10shot_accuracy": a * f ** 0.1 if f < 1 or m != "BiT-mu" else None, "10shot_step": 10}
    for m, x, a in (("Ti/8", 2e-6, 0.5), ("BiT-mu", 5e-6, 0.6)) for f in (0.25, 0.5, 1.0)
]


def rgb(png: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB"))


def has_colour(pixels: np.ndarray, colour) -> bool:
    want = np.round(np.array(colour[:3]) * 255)
    return bool((np.abs(pixels.astype(int) - want).max(axis=-1) <= 2).any())


def test_both_figures_draw_each_model_in_its_colour_one_panel_per_shot_count():
    figs = study.figures(ROWS)
    assert set(figs) == {"study_accuracy_by_images.png", "study_accuracy_by_exaflops.png"}
    one_shot = study.figures([{k: v for k, v in r.items() if not k.startswith("10shot")} for r in ROWS])
    for name, png in figs.items():
        pixels = rgb(png)
        # Two panels (5- and 10-shot) side by side: wider than the one-panel figure.
        assert pixels.shape[1] > 1.6 * rgb(one_shot[name]).shape[1], name
        for colour in plots.colours(2):
            assert has_colour(pixels, colour), (name, colour)


def test_task_columns_draw_a_panel_each_named_for_the_task():
    # --task NAME=DIR columns are NAME_<k>shot_accuracy; --fewshot-data's stay <k>shot_accuracy.
    tasks = [{**{k: v for k, v in r.items() if "shot" not in k}, "digits_5shot_accuracy": r["5shot_accuracy"],
              "count_5shot_accuracy": r["5shot_accuracy"] / 2, "5shot_accuracy": r["5shot_accuracy"]} for r in ROWS]
    assert plots.shot_keys(tasks) == ["5shot_accuracy", "count_5shot_accuracy", "digits_5shot_accuracy"]
    assert plots.shot_name("count_5shot_accuracy") == "count 5-shot"
    figs = study.figures(tasks)
    one = study.figures([{k: v for k, v in r.items() if not k.startswith(("digits", "count"))} for r in tasks])
    for name, png in figs.items():  # three panels side by side
        assert rgb(png).shape[1] > 2.4 * rgb(one[name]).shape[1], name


def test_families_follow_the_variant_names():
    assert [plots.model_family(m) for m in ("Ti/16", "B/32", "BiT-R50x1", "BiT-mu", "R50+B/16", "R26+S/32")] == \
        ["ViT", "ViT", "ResNet", "ResNet", "hybrid", "hybrid"]


def test_a_table_without_few_shot_scores_draws_nothing():
    bare = [{k: v for k, v in r.items() if "shot" not in k} for r in ROWS]
    assert study.figures(bare) == {name: None for name in study.FIGURES}
    assert study.figures([{**r, "5shot_accuracy": None, "10shot_accuracy": None} for r in ROWS]) == \
        {name: None for name in study.FIGURES}


def log_study(rows: list[dict], *, finish: bool) -> tuple[str, dict]:
    """A study parent run with one pretrain run per row, logged as training.study logs them (no training);
    with ``finish`` it logs its table, as a study that ran to its end."""
    with tracking.start_run("study", params={"data": "/data/shards/corpus"}, run_name="study on corpus") as parent:
        table = {"rows": [], "mlflow_run_id": parent.info.run_id}
        for r in rows:
            with tracking.start_run("pretrain", params={"data": "/data/shards/corpus", "variant": r["model"],
                                                        "fraction": r["fraction"], "output": f"/s/{r['model']}"},
                                    parent_run_id=parent.info.run_id, run_name=f"{r['model']} f{r['fraction']}") as cell:
                scores = {f"best_fewshot_{k}": v for k, v in r.items() if "shot_" in k and v is not None}
                tracking.log_metrics({"train_rows": r["images"], "steps": r["steps"], "holdout_accuracy": 0.1,
                                      "best_fewshot_step": r["best_step"], **scores})
            table["rows"].append({**r, "mlflow_run_id": cell.info.run_id})
            time.sleep(0.01)
        if finish:
            tracking.log_dict(table, "study_table.json")
    return parent.info.run_id, table


def test_the_job_writes_both_figures_beside_the_table_and_on_the_parent_run(mlflow_store, tmp_path):
    study_id, table = log_study(ROWS[:2], finish=True)
    written = study.write_figures(table, tmp_path)
    assert sorted(p.name for p in written) == sorted(study.FIGURES)
    assert all(p.parent == tmp_path and p.stat().st_size > 1000 for p in written)
    logged = {a.path for a in mlflow.MlflowClient(tracking.tracking_uri()).list_artifacts(study_id)}
    assert set(study.FIGURES) | {"study_table.json"} <= logged


def test_the_report_shows_a_study_as_a_study_and_does_not_rank_its_cells(mlflow_store, tmp_path):
    study_id, table = log_study(ROWS, finish=True)
    with tracking.start_run("pretrain", params={"data": "/data/shards/corpus", "variant": "S/16"},
                            run_name="alone") as alone:
        tracking.log_metrics({"holdout_accuracy": 0.9})
    r = run_report(ReportConfig(output=str(tmp_path / "report.html"), run_id=[study_id, alone.info.run_id]))
    assert r["studies"] == [study_id] and r["runs"] == 1 + len(ROWS)
    # The one pretrain run outside the study is ranked alone: the six cells are not its competitors.
    [pre] = [k for k in r["rankings"] if k["group"].startswith("pretrain")]
    assert pre["best"] == alone.info.run_id and pre["verdict"].startswith("One run")
    page = (tmp_path / "report.html").read_text()
    part = section(page, "study")
    assert "6 pre-training runs are cells of study study on corpus" in section(page, "summary")
    assert part.count("<tr>") == 1 + len(ROWS) and "ResNet" in part and "ViT" in part
    assert "The table the study logged when it ended." in part and f"{ROWS[-1]['exaflops']:.3g}" in part
    # At fraction 1 only the ViT has a 10-shot score; at 0.25 the BiT leads.
    assert ("Best 10-shot accuracy, at fraction 0.25 (200 images) BiT-mu leads with 0.522 (then Ti/8 0.435); "
            "at fraction 1 (800 images) Ti/8 leads with 0.500, the only model scored there.") in part
    assert len(re.findall(r'src="data:image/png;base64,', part)) == 2
    assert "cell of study" in section(page, "pretraining")


def test_a_stopped_study_is_rebuilt_from_its_cells_and_found_through_them(mlflow_store):
    study_id, table = log_study(ROWS[:3], finish=False)
    store = open_store(tracking.tracking_uri())
    # A selection of one cell reports its study.
    runs = compare.selection(store, [], [table["rows"][1]["mlflow_run_id"]])
    studies = study.studies(store, runs, [], [table["rows"][1]["mlflow_run_id"]])
    assert [s.id for s in studies] == [study_id]
    [entry] = compare.build(store, runs, studies)["studies"]
    assert not entry["from_artifact"]
    assert [(row["model"], row["fraction"], row["images"], row["5shot_accuracy"], row["exaflops"])
            for row in entry["rows"]] == [(r["model"], r["fraction"], r["images"], r["5shot_accuracy"], None)
                                          for r in ROWS[:3]]
    # Figure 4 from the cells' images; no Figure 5 without the exaFLOPs the table brings.
    assert entry["figures"]["study_accuracy_by_images.png"] and entry["figures"]["study_accuracy_by_exaflops.png"] is None
    part = section(html.render(compare.build(store, runs, studies), {}, store_uri="x", selection="y"), "study")
    assert "has not logged its table" in part and len(re.findall(r'src="data:image/png;base64,', part)) == 1
