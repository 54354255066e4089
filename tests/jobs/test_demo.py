"""The end-to-end chain that `make demo` runs, at test size: every stage, every count, every MLflow run."""
import json

import mlflow
import pyarrow.ipc as ipc

from common import tracking
from demo.run import format_table
from pipelines.schema import MANIFEST


def test_ingest_counts_reconcile_and_planted_copies_are_dropped(small_demo):
    s = small_demo["summary"]
    c = s["prepare"]["corpus"]
    data = s["data"]
    assert c["inputs"] == data["corpus_images"]
    assert c["inputs"] == c["written"] + sum(c["rejected"].values()) + sum(c["duplicates"].values())
    assert sum(c["rejected"].values()) == data["corrupt"]
    assert c["duplicates"]["corpus"] == data["exact_copies"]
    assert c["duplicates"]["digits_test"] == data["planted"]


def test_planted_copies_are_absent_from_the_shards(small_demo):
    corpus = small_demo["work"] / "shards" / "corpus"
    manifest = json.loads((corpus / MANIFEST).read_text())
    sources = []
    for shard in manifest["shards"]:
        with ipc.open_file(corpus / shard["path"]) as f:
            sources += f.read_all().column("source").to_pylist()
    assert len(sources) == manifest["counts"]["written"]
    assert not [s for s in sources if "planted_" in s]


def test_every_stage_is_an_mlflow_run_under_the_demo(small_demo):
    s = small_demo["summary"]
    client = mlflow.MlflowClient(tracking.tracking_uri())
    demo_id = s["mlflow_run_id"]
    children = client.search_runs(
        [client.get_run(demo_id).info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{demo_id}'"
    )
    stages = sorted(r.data.tags["vitscale.stage"] for r in children)
    # 3 prepares for the corpus and digits, 3 per VTAB-style task (train800, val200, test)
    assert stages == ["finetune"] + ["prepare"] * 12 + ["pretrain", "vtab"]
    finetune = next(r for r in children if r.data.tags["vitscale.stage"] == "finetune")
    trials = client.search_runs(
        [finetune.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{finetune.info.run_id}'"
    )
    select = [t for t in trials if t.data.tags["vitscale.stage"] == "finetune-select"]
    final = [t for t in trials if t.data.tags["vitscale.stage"] == "finetune-final"]
    assert sorted(float(t.data.params["lr"]) for t in select) == [0.01, 0.1]
    assert all("test_accuracy" in t.data.metrics for t in trials)
    assert len(final) == 1 and float(final[0].data.params["lr"]) == s["finetune"]["selected_lr"]
    vtab = next(r for r in children if r.data.tags["vitscale.stage"] == "vtab")
    vtab_trials = client.search_runs(
        [vtab.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{vtab.info.run_id}'"
    )
    assert len(vtab_trials) == 3 * 4 + 3  # tasks x settings, then each task once more
    pretrain = next(r for r in children if r.data.tags["vitscale.stage"] == "pretrain")
    assert len(client.get_metric_history(pretrain.info.run_id, "train_loss")) >= 2


def test_results_table_reports_every_stage(small_demo):
    table = format_table(small_demo["summary"])
    for text in ("near-duplicates of test set", "final train loss", "<- selected", "retrained on all of train",
                 "VTAB-1k (setting", "natural mean", "specialized mean", "structured mean",
                 "mlflow ui --backend-store-uri sqlite:///"):
        assert text in table
