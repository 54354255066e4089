"""Ranking and lineage on runs logged through common.tracking into a real sqlite store.

The runs carry the params and metrics the stages log, without training anything: what is tested
is how the report reads and compares them (tests/reports/test_report.py runs the real chain).
"""
from __future__ import annotations

import time

import pytest

from common import tracking
from common.config import not_recipe
from reports import compare, html
from reports.lineage import LineageIndex
from reports.store import open_store

FINETUNE = {"train": "/data/shards/pets-train", "test": "/data/shards/pets-test", "steps": "500", "batch_size": "512",
            "seed": "0", "dataset": "None"}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("VITSCALE_HOME", str(tmp_path))
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "VITSCALE_PARENT_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def where_tag(stage: str) -> dict:
    """The tag a stage writes naming its config's where-it-ran fields (common.config.not_recipe)."""
    from dedup.job import DedupConfig
    from pipelines.config import PrepareConfig
    from training.pretrain import PretrainConfig
    from transfer.finetune import FinetuneConfig

    cls = {"prepare": PrepareConfig, "dedup": DedupConfig, "pretrain": PretrainConfig, "finetune": FinetuneConfig}.get(stage)
    return {tracking.TAG_NOT_RECIPE: ",".join(sorted(not_recipe(cls)))} if cls else {}


def log(stage: str, params: dict, metrics: dict, *, name: str | None = None, tags: dict | None = None) -> str:
    with tracking.start_run(stage, params=params, run_name=name, tags={**where_tag(stage), **(tags or {})}) as run:
        tracking.log_metrics(metrics)
    time.sleep(0.01)  # distinct start times: lineage orders writers by them
    return run.info.run_id


def test_the_best_run_is_named_with_the_params_that_differ(home):
    prep = log("prepare", {"output": "/data/shards/pets-train", "test_set": "[]"}, {"inputs": 100})
    pre_a = log("pretrain", {"data": "/data/shards/corpus", "output": "/runs/a", "epochs": "7"}, {"holdout_accuracy": 0.5})
    fa = log("finetune", {**FINETUNE, "pretrained": "/runs/a/model.safetensors", "output": "/ft/1"},
             {"test_accuracy": 0.81, "val_accuracy": 0.80, "selected_lr": 0.01})
    pre_b = log("pretrain", {"data": "/data/shards/corpus", "output": "/runs/a", "epochs": "14"}, {"holdout_accuracy": 0.6})
    fb = log("finetune", {**FINETUNE, "pretrained": "/runs/a/model.safetensors", "output": "/ft/2", "steps": "1000"},
             {"test_accuracy": 0.88, "val_accuracy": 0.85, "selected_lr": 0.03})
    store = open_store(tracking.tracking_uri())
    runs = compare.selection(store, [], [])
    [ft] = [r for r in compare.rank(store, runs, LineageIndex(store)) if r.stage == "finetune"]
    assert [r.id for r in ft.runs] == [fb, fa]
    # The same model path was written twice: each finetune read the pretrain that last wrote it before it started.
    assert ft.values[fb]["lineage: pretrain"].endswith(f"({pre_b[:8]})")
    assert ft.values[fa]["lineage: pretrain"].endswith(f"({pre_a[:8]})")
    assert ft.values[fa]["lineage: prepare"].endswith(f"({prep[:8]})")
    # Where a run wrote never explains a difference; what it trained on and how does.
    assert set(ft.differing) == {"steps", "lineage: pretrain"}
    assert "train" in ft.same and "output" not in ft.same
    assert "best on val_accuracy: 0.850 against 0.800" in ft.verdict and "(+0.050)" in ft.verdict
    assert "test_accuracy, is 0.880" in ft.verdict and "steps 1000 vs 500" in ft.verdict
    page = html.render(compare.build(store, runs), {}, store_uri="x", selection="every experiment")
    # The runner-ups' differing cells: the finetune's steps and pretrain, the pretrain's epochs.
    assert page.count('class="diff"') == 3


def test_lineage_tags_win_over_paths(home):
    prep = log("prepare", {"output": "/data/shards/corpus"}, {"inputs": 10})
    dedup = log("dedup", {"shards": "/data/shards/corpus", "test_set": '["pets=/data/pets/test"]'},
                {"new_removals": 3, "removed.pets": 3})
    other = log("prepare", {"output": "/elsewhere"}, {"inputs": 10})
    tagged = log("pretrain", {"data": "/data/shards/corpus", "output": "/runs/t"}, {"train_loss": 1.0},
                 tags={"vitscale.lineage.prepare": other, "vitscale.lineage.dedup": ""})
    inferred = log("pretrain", {"data": "/data/shards/corpus", "output": "/runs/u"}, {"train_loss": 1.0})
    store = open_store(tracking.tracking_uri())
    index = LineageIndex(store)
    t = index.of(store.runs[tagged])
    assert t.source == "tags" and t.upstream["prepare"] == [other] and t.upstream["dedup"] == []
    i = index.of(store.runs[inferred])
    assert i.source == "paths" and i.upstream["prepare"] == [prep] and i.upstream["dedup"] == [dedup]
    section = compare.dedup_section(compare.selection(store, [], []))
    row = next(r for r in section["rows"] if r["run"].id == dedup)
    assert row["counts"] == {"pets": 3} and section["test_sets"] == ["pets"]


def _manifest(digest: str) -> dict:
    return {"vitscale.input_manifest_sha256": digest * 64}


def test_pretraining_runs_on_other_data_or_objectives_are_not_ranked_together(home):
    # A 20-image, one-class run was called "best on holdout_accuracy: 1.000" against runs on a real corpus.
    tiny = log("pretrain", {"data": "/d/tiny", "objective": "classification"}, {"holdout_accuracy": 1.0},
               tags=_manifest("a"))
    big = log("pretrain", {"data": "/d/corpus", "objective": "classification"}, {"holdout_accuracy": 0.4},
              tags=_manifest("b"))
    mpp = log("pretrain", {"data": "/d/corpus", "objective": "mpp"}, {"holdout_accuracy": 0.9}, tags=_manifest("b"))
    rewritten = log("pretrain", {"data": "/d/corpus", "objective": "classification"}, {"holdout_accuracy": 0.8},
                    tags=_manifest("c"))  # the same folder, prepared again from other inputs
    store = open_store(tracking.tracking_uri())
    rankings = [r for r in compare.rank(store, compare.selection(store, [], []), LineageIndex(store))
                if r.stage == "pretrain"]
    assert sorted([r.id for r in ranking.runs] for ranking in rankings) == sorted([[tiny], [big], [mpp], [rewritten]])
    assert f"pretrain objective classification on corpus (data {'c' * 12})" in {r.title for r in rankings}
    assert all(r.verdict.startswith("One run") for r in rankings)


def test_re_ingests_of_the_same_images_are_ranked_together_by_what_the_shards_hold(home):
    # Each prepare writes its own run id into the manifest, so the manifest digests differ.
    first = log("pretrain", {"data": "/d/corpus"}, {"holdout_accuracy": 0.5},
                tags={**_manifest("a"), "vitscale.input_data_sha256": "d" * 64})
    again = log("pretrain", {"data": "/d/corpus"}, {"holdout_accuracy": 0.5},
                tags={**_manifest("b"), "vitscale.input_data_sha256": "d" * 64})
    other = log("pretrain", {"data": "/d/corpus"}, {"holdout_accuracy": 0.7},
                tags={**_manifest("b"), "vitscale.input_data_sha256": "e" * 64})
    store = open_store(tracking.tracking_uri())
    rankings = [r for r in compare.rank(store, compare.selection(store, [], []), LineageIndex(store))
                if r.stage == "pretrain"]
    assert sorted(sorted(r.id for r in ranking.runs) for ranking in rankings) == sorted([sorted([first, again]), [other]])


def test_two_prepare_runs_of_the_same_images_rank_their_stage_runs_together(home, tmp_path):
    # Two demos once each said "One run ...; nothing to rank against": the report matched the
    # manifest's digest, and each manifest names the prepare run that wrote it.
    from common.photos import photo
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare
    from pipelines.schema import shard_set_record

    for cls, name in (("cat", "chelsea.png"), ("coffee", "coffee.png")):
        (tmp_path / "src" / cls).mkdir(parents=True)
        for i in range(3):
            photo(name).crop((i * 30, i * 20, i * 30 + 160, i * 20 + 160)).save(tmp_path / "src" / cls / f"{i}.png")
    records = []
    for out in ("first/shards", "again-shards"):
        run_prepare(PrepareConfig(input=[str(tmp_path / "src")], output=str(tmp_path / out), size=32, workers=1))
        records.append(shard_set_record(tmp_path / out, role="training"))
    assert records[0]["manifest_sha256"] != records[1]["manifest_sha256"]
    runs = [log("pretrain", {"data": r["url"], "objective": "classification"}, {"holdout_accuracy": acc},
                tags=tracking.run_tags(None, data=[r])) for r, acc in zip(records, (0.5, 0.6))]
    store = open_store(tracking.tracking_uri())
    [ranking] = [r for r in compare.rank(store, compare.selection(store, [], []), LineageIndex(store))
                 if r.stage == "pretrain"]
    assert [r.id for r in ranking.runs] == runs[::-1]
    assert ranking.title == "pretrain objective classification on again-shards, shards"
    assert "lineage: prepare" in ranking.differing and not ranking.verdict.startswith("One run")


def test_a_prepare_that_wrote_nothing_shows_its_written_and_quarantined_counts(home):
    empty = log("prepare", {"output": "/data/shards/empty"}, {"inputs": 6, "written": 0, "rejected": 6})
    store = open_store(tracking.tracking_uri())
    section = compare.dedup_section(compare.selection(store, [], []))
    row = next(r for r in section["rows"] if r["run"].id == empty)
    assert (row["total"], row["written"], row["rejected"]) == (6, 0, 6)
    page = html.render(compare.build(store, compare.selection(store, [], [])), {}, store_uri="x", selection="all")
    assert "<th>written</th>" in page and "<th>quarantined</th>" in page


def test_finetuning_is_ranked_on_the_selection_metric_and_reports_test_as_the_result(home):
    picked_by_val = log("finetune", {**FINETUNE, "output": "/ft/1", "seed": "1"},
                        {"val_accuracy": 0.9, "test_accuracy": 0.70})
    better_on_test = log("finetune", {**FINETUNE, "output": "/ft/2", "seed": "2"},
                         {"val_accuracy": 0.8, "test_accuracy": 0.75})
    no_val = log("finetune", {**FINETUNE, "train": "/data/shards/other-train"}, {"test_accuracy": 0.99})
    store = open_store(tracking.tracking_uri())
    rankings = {tuple(r.id for r in x.runs): x for x in compare.rank(store, compare.selection(store, [], []),
                                                                     LineageIndex(store)) if x.stage == "finetune"}
    ft = rankings[(picked_by_val, better_on_test)]
    assert ft.metric == "val_accuracy" and "test_accuracy, is 0.700" in ft.verdict
    assert rankings[(no_val,)].metric == ""  # never ranked on test accuracy


def test_a_resumed_shorter_schedule_is_not_called_run_to_run_variation(home):
    # A time-boxed 12-step submission and a 24-step run share every param; their gap is the schedule.
    params = {"data": "/d/corpus", "steps": "24", "run_name": "None"}
    full = log("pretrain", params, {"holdout_accuracy": 0.6, "steps": 24, "planned_steps": 24}, tags=_manifest("b"))
    log("pretrain", {**params, "run_name": "boxed", "stop_after": "6"},
        {"holdout_accuracy": 0.3, "steps": 6, "planned_steps": 24}, tags=_manifest("b"))
    boxed = log("pretrain", {**params, "run_name": "boxed", "stop_after": "12"},
                {"holdout_accuracy": 0.5, "steps": 12, "planned_steps": 24}, tags=_manifest("b"))
    store = open_store(tracking.tracking_uri())
    [pre] = [r for r in compare.rank(store, compare.selection(store, [], []), LineageIndex(store))
             if r.stage == "pretrain"]
    assert [r.id for r in pre.runs][:2] == [full, boxed]
    assert "run-to-run variation" in pre.verdict and "not run-to-run variation" in pre.verdict
    assert "steps 24 vs 12 of 24 planned" in pre.verdict and "resumed from a checkpoint: no vs yes" in pre.verdict


def test_a_rerun_under_the_same_name_is_not_called_resumed(home):
    # Two demos in one folder: both pre-train "demo-pretrain" from step 0; a third resumed from step 8.
    params = {"data": "/d/corpus", "steps": "24", "run_name": "demo-pretrain"}
    metrics = {"holdout_accuracy": 0.5, "steps": 24, "planned_steps": 24, "resumed_from_step": 0}
    first = log("pretrain", params, metrics, tags=_manifest("b"))
    again = log("pretrain", params, {**metrics, "holdout_accuracy": 0.4}, tags=_manifest("b"))
    store = open_store(tracking.tracking_uri())
    [pre] = [r for r in compare.rank(store, compare.selection(store, [], []), LineageIndex(store))
             if r.stage == "pretrain"]
    assert [r.id for r in pre.runs] == [first, again] and "resumed" not in pre.verdict
    log("pretrain", params, {**metrics, "holdout_accuracy": 0.6, "resumed_from_step": 8}, tags=_manifest("b"))
    store = open_store(tracking.tracking_uri())
    [pre] = [r for r in compare.rank(store, compare.selection(store, [], []), LineageIndex(store))
             if r.stage == "pretrain"]
    assert "resumed from a checkpoint: yes vs no" in pre.verdict


def test_a_dedup_run_that_found_nothing_counts_whole_images_and_no_column_is_named_twice(home):
    import re

    log("dedup", {"shards": "/data/shards/corpus", "test_set": '["pets=/data/pets/test"]'},
        {"new_removals": 0, "rows_scanned": 0, "removed.pets": 0})
    params = {"data": "/d/corpus", "steps": "24"}
    log("pretrain", params, {"holdout_accuracy": 0.6, "steps": 24}, tags=_manifest("b"))
    log("pretrain", {**params, "steps": "12"}, {"holdout_accuracy": 0.5, "steps": 12}, tags=_manifest("b"))
    store = open_store(tracking.tracking_uri())
    page = html.render(compare.build(store, compare.selection(store, [], [])), {}, store_uri="x", selection="all")
    assert "0.000" not in page
    for head in re.findall(r"<tr>((?:<th[^>]*>.*?</th>)+)</tr>", page):
        names = re.findall(r"<th[^>]*>(.*?)</th>", head)
        assert len(names) == len(set(names)), names
    assert "steps (param)" in page
