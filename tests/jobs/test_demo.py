"""The end-to-end chain that `make demo` runs, at test size: every stage, every count, every MLflow run."""
import json
from pathlib import Path

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


def _all_runs(client, filter_string: str = ""):
    return client.search_runs([e.experiment_id for e in client.search_experiments()], filter_string=filter_string,
                              max_results=1000)


def _top_level(client, demo_id: str):
    """The demo's stage runs: tagged with the demo's id, not nested under another run."""
    return [r for r in _all_runs(client, f"tags.`vitscale.demo_run_id` = '{demo_id}'")
            if "mlflow.parentRunId" not in r.data.tags]


def test_every_stage_is_a_run_in_its_own_experiment_naming_the_demo(small_demo):
    s = small_demo["summary"]
    client = mlflow.MlflowClient(tracking.tracking_uri())
    demo_id = s["mlflow_run_id"]
    demo = client.get_run(demo_id)
    assert client.get_experiment(demo.info.experiment_id).name == "vitscale-demo"
    stages = _top_level(client, demo_id)
    # 3 prepares for the corpus and digits, 3 per VTAB-style task (train800, val200, test); the
    # demo ends with the comparison report
    assert sorted(r.data.tags["vitscale.stage"] for r in stages) == (
        ["dedup", "fewshot", "finetune"] + ["prepare"] * 12 + ["pretrain", "report", "vtab"])
    for r in stages:
        exp = client.get_experiment(r.info.experiment_id)
        assert exp.name == f"vitscale-{r.data.tags['vitscale.stage']}", exp.name
        assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
        assert r.data.tags["vitscale.parent_run_id"] == demo_id and r.info.status == "FINISHED"
    # Readable names that tell the runs apart.
    names = [r.info.run_name for r in stages]
    assert len(set(names)) == len(names), names
    assert "prepare corpus" in names and "prepare digits/train800" in names
    assert any(n.startswith("pretrain Ti8 on corpus") for n in names), names

    finetune = next(r for r in stages if r.data.tags["vitscale.stage"] == "finetune")
    assert finetune.info.run_name.endswith(f"lr={s['finetune']['selected_lr']:g}")
    trials = client.search_runs(
        [finetune.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{finetune.info.run_id}'"
    )
    select = [t for t in trials if t.data.tags["vitscale.stage"] == "finetune-select"]
    final = [t for t in trials if t.data.tags["vitscale.stage"] == "finetune-final"]
    assert sorted(float(t.data.params["lr"]) for t in select) == [0.01, 0.1]
    assert all("test_accuracy" in t.data.metrics for t in trials)
    assert len(final) == 1 and float(final[0].data.params["lr"]) == s["finetune"]["selected_lr"]
    vtab = next(r for r in stages if r.data.tags["vitscale.stage"] == "vtab")
    vtab_trials = client.search_runs(
        [vtab.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{vtab.info.run_id}'"
    )
    assert len(vtab_trials) == 3 * 2 + 3  # tasks x settings, then each task once more
    fewshot = next(r for r in stages if r.data.tags["vitscale.stage"] == "fewshot")
    tasks = client.search_runs(
        [fewshot.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{fewshot.info.run_id}'"
    )
    assert len(tasks) == 3
    pretrain = next(r for r in stages if r.data.tags["vitscale.stage"] == "pretrain")
    # Curves, not single points: the loss at the step lines (every log_every steps; this small
    # demo trains few) and all ranks' loss at each checkpoint.
    assert client.get_metric_history(pretrain.info.run_id, "train_loss")
    assert len(client.get_metric_history(pretrain.info.run_id, "checkpoint_train_loss")) >= 2
    # Every run of the demo, children included, is found by the demo's id.
    assert len(_all_runs(client, f"tags.`vitscale.demo_run_id` = '{demo_id}'")) == len(stages) + 3 + 9 + 3  # finetune trials, vtab, few-shot tasks


def _sha256(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_lineage_tags_link_the_demo_runs_end_to_end(small_demo):
    s, work = small_demo["summary"], small_demo["work"]
    client = mlflow.MlflowClient(tracking.tracking_uri())
    stages = _top_level(client, s["mlflow_run_id"])
    by_stage = {}
    for r in stages:
        by_stage.setdefault(r.data.tags["vitscale.stage"], []).append(r)
    for r in stages:
        assert r.data.tags["vitscale.git_commit"] and len(r.data.tags["vitscale.config_hash"]) == 16
    prepares = {r.info.run_id: r for r in by_stage["prepare"]}
    corpus_manifest = json.loads((work / "shards" / "corpus" / MANIFEST).read_text())
    corpus_prep = prepares[corpus_manifest["mlflow_run_id"]]
    assert corpus_prep.data.tags["vitscale.output_manifest_sha256"] == _sha256(work / "shards" / "corpus" / MANIFEST)
    assert corpus_prep.data.tags["vitscale.dedup_state"] == f"ingest vs digits_test: {s['data']['planted']} removed"
    train_prep = json.loads((work / "shards" / "digits-train" / MANIFEST).read_text())["mlflow_run_id"]
    test_prep = json.loads((work / "shards" / "digits-test" / MANIFEST).read_text())["mlflow_run_id"]

    (dedup,) = by_stage["dedup"]
    assert dedup.data.tags["vitscale.lineage.prepare"] == corpus_prep.info.run_id
    assert dedup.data.tags["vitscale.input_manifest_sha256"] == _sha256(work / "shards" / "corpus" / MANIFEST)

    (pre,) = by_stage["pretrain"]
    t = pre.data.tags
    assert t["vitscale.input_manifest_sha256"] == _sha256(work / "shards" / "corpus" / MANIFEST)
    assert t["vitscale.lineage.prepare"] == corpus_prep.info.run_id
    assert t["vitscale.lineage.dedup"] == dedup.info.run_id
    assert "ingest vs digits_test" in t["vitscale.dedup_state"] and "dedup signature_v" in t["vitscale.dedup_state"]
    assert json.loads((work / "pretrain" / tracking.LINEAGE_FILE).read_text())["run_id"] == pre.info.run_id

    (fine,) = by_stage["finetune"]
    t = fine.data.tags
    assert t["vitscale.lineage.pretrain"] == pre.info.run_id and t["vitscale.lineage.dedup"] == dedup.info.run_id
    assert t["vitscale.lineage.prepare"].split(",") == [corpus_prep.info.run_id, train_prep, test_prep]
    assert t["vitscale.input_manifest_sha256"] == _sha256(work / "shards" / "digits-train" / MANIFEST)
    for stage in ("vtab", "fewshot"):
        (r,) = by_stage[stage]
        assert r.data.tags["vitscale.lineage.pretrain"] == pre.info.run_id, stage
        ids = r.data.tags["vitscale.lineage.prepare"].split(",")
        assert ids[0] == corpus_prep.info.run_id and len(ids) == 1 + 9, stage  # corpus, then 3 splits x 3 tasks
        assert set(ids[1:]) <= set(prepares)


def test_which_data_trained_this_model_is_a_tag_search(small_demo):
    s = small_demo["summary"]
    client = mlflow.MlflowClient(tracking.tracking_uri())
    exps = [e.experiment_id for e in client.search_experiments()]
    # From the fine-tuned model's run: the prepare runs (and so the sources) of every image it learned from.
    fine = client.get_run(s["finetune"]["mlflow_run_id"])
    ids = fine.data.tags["vitscale.lineage.prepare"].split(",")
    quoted = ", ".join(f"'{i}'" for i in ids)
    sources = client.search_runs(exps, filter_string=f"attributes.run_id IN ({quoted})")
    assert sorted(json.loads(r.data.params["input"])[0] for r in sources) == sorted(
        str(s["data"][k]) for k in ("corpus", "train", "test"))
    # And the other way: every model trained (directly or not) on the pre-training run's output.
    pre_id = s["pretrain"]["mlflow_run_id"]
    downstream = client.search_runs(exps, filter_string=f"tags.`vitscale.lineage.pretrain` = '{pre_id}'")
    assert sorted(r.data.tags["vitscale.stage"] for r in downstream) == ["fewshot", "finetune", "vtab"]


def test_the_models_are_mlflow_models_that_load_without_pickle_and_predict(small_demo):
    import numpy as np
    import torch
    from PIL import Image

    import vitcore

    s = small_demo["summary"]
    mlflow.set_tracking_uri(tracking.tracking_uri())  # models:/ URIs resolve in the tracking store
    # Real images of the digits test set, at another size than the model's 32 px.
    paths = sorted(p for p in Path(s["data"]["test"]).rglob("*") if p.is_file())[:5]
    images = np.stack([np.asarray(Image.open(p).convert("RGB").resize((40, 40))) for p in paths])
    assert images.shape == (5, 40, 40, 3)
    for stage, n_classes in (("pretrain", s["data"]["classes"]), ("finetune", s["data"]["downstream_classes"])):
        uri = s[stage]["mlflow_model_uri"]
        out = mlflow.pyfunc.load_model(uri).predict({"image": list(images)})
        direct = vitcore.load_checkpoint(s[stage]["model"]).eval()
        x = np.stack([np.asarray(Image.fromarray(im).resize((32, 32), Image.BILINEAR)) for im in images])
        with torch.inference_mode():
            logits = direct((torch.from_numpy(x).permute(0, 3, 1, 2).float() - 127.5) / 127.5)
        assert out.shape == (5, n_classes) == tuple(logits.shape)
        np.testing.assert_allclose(out.to_numpy(), torch.softmax(logits, dim=-1).numpy(), atol=1e-5)
        assert len(set(out.columns)) == n_classes  # the classes by name
        # No pickle anywhere in the model: the code, its vitcore, and the safetensors weights.
        files = [p.name for p in Path(mlflow.artifacts.download_artifacts(uri)).rglob("*") if p.is_file()]
        assert "model.safetensors" in files and "mlflow_model.py" in files, files
        assert not [f for f in files if f.endswith((".pkl", ".pickle", ".pt", ".pth", ".bin"))], files


def test_runs_log_their_shard_sets_plots_and_system_metrics(small_demo):
    s, work = small_demo["summary"], small_demo["work"]
    client = mlflow.MlflowClient(tracking.tracking_uri())
    pre = client.get_run(s["pretrain"]["mlflow_run_id"])
    (corpus,) = [d for d in pre.inputs.dataset_inputs if d.dataset.name == "corpus"]
    assert corpus.dataset.digest == _sha256(work / "shards" / "corpus" / MANIFEST)[:36]
    assert str(work / "shards" / "corpus") in corpus.dataset.source
    fine = client.get_run(s["finetune"]["mlflow_run_id"])
    assert {d.dataset.name for d in fine.inputs.dataset_inputs} == {"digits-train", "digits-test"}
    vtab = client.get_run(s["vtab"]["mlflow_run_id"])
    assert len(vtab.inputs.dataset_inputs) == 9

    for run_id, path in ((pre.info.run_id, "plots/pretrain_curves.png"), (fine.info.run_id, "plots/finetune_grid.png")):
        local = client.download_artifacts(run_id, path, str(work / "downloaded"))
        data = open(local, "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, path
    # System metrics on the training runs, and their sampling thread stopped with the run.
    assert any(k.startswith("system/") for k in pre.data.metrics), sorted(pre.data.metrics)
    import threading

    assert not [t for t in threading.enumerate() if "SystemMetrics" in t.name or "system_metrics" in t.name]


def test_results_table_reports_every_stage(small_demo):
    table = format_table(small_demo["summary"])
    for text in ("near-duplicates of test set", "final train loss", "<- selected", "retrained on all of train",
                 "VTAB-1k (setting", "natural mean", "specialized mean", "structured mean",
                 "mlflow ui --backend-store-uri sqlite:///", "Few-shot linear evaluation",
                 "vitscale-pretrain", "workflowType=machine_learning"):
        assert text in table
