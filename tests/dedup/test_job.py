"""The scheduled job end to end: a real ingest shard set, real MLflow store, incremental re-checks."""
import json
from pathlib import Path

import mlflow
import pytest

from common.config import ConfigError
from dedup.job import DedupConfig, run
from neardup.transforms import apply
from pipelines.schema import MANIFEST
from tests.conftest import new_home


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, photos, tiles):
    root = tmp_path_factory.mktemp("dedup_job")
    (root / "corpus").mkdir()
    for i, img in enumerate(tiles[:10:2]):
        img.save(root / "corpus" / f"distinct_{i}.png")
    planted = {"astro_small.png": ("astronaut.png", "resize_0.5"), "cat_q30.jpg": ("chelsea.png", "jpeg_q30"),
               "coffee_crop.png": ("coffee.png", "crop_10_left")}
    for fname, (name, transform) in planted.items():
        apply(transform, photos[name]).save(root / "corpus" / fname)
    for split, names in (("set_a", ["astronaut.png", "chelsea.png"]), ("set_b", ["coffee.png"])):
        (root / split).mkdir()
        for name in names:
            photos[name].save(root / split / Path(name).with_suffix(".png").name)
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    mp = pytest.MonkeyPatch()
    mp.setenv("VITSCALE_HOME", str(new_home(root / "mlruns")))
    run_prepare(PrepareConfig(input=[str(root / "corpus")], output=str(root / "shards"), size=160, workers=1,
                              shard_mb=0.05))
    mp.undo()
    return root


def _removed(shards: Path) -> list[dict]:
    return [json.loads(line) for line in (shards / "removed.jsonl").read_text().splitlines()]


def test_job_removes_planted_duplicates_incrementally(corpus, monkeypatch):
    monkeypatch.setenv("VITSCALE_HOME", str(corpus / "mlruns"))
    shards = corpus / "shards"
    cfg_a = DedupConfig(shards=str(shards), test_set=[f"set_a={corpus / 'set_a'}"])

    first = run(cfg_a)
    removed = _removed(shards)
    assert first["new_removals"] == 2 and {r["test_set"] for r in removed} == {"set_a"}
    assert {r["matched_key"] for r in removed} == set(_index_keys(shards, "set_a"))
    for name in ("counts.md", "matches.jsonl", "contact_sheet.png"):
        assert (shards / "dedup_report" / name).stat().st_size > 0

    from pipelines.schema import ShardSet
    total = json.loads((shards / MANIFEST).read_text())["num_rows"]
    assert len(ShardSet(shards)) == total - 2

    second = run(cfg_a)
    assert second["nothing_new"] and second["pairs_checked"] == 0 and "nothing new" in second["message"]
    assert len(_removed(shards)) == 2

    cfg_ab = DedupConfig(shards=str(shards), test_set=cfg_a.test_set + [f"set_b={corpus / 'set_b'}"])
    third = run(cfg_ab)
    assert third["pairs_checked"] == third["shards_total"]  # only set_b was checked against each shard
    assert third["removals_per_test_set"] == {"set_a": 0, "set_b": 1}
    assert len(_removed(shards)) == 3

    mlflow.set_tracking_uri(f"sqlite:///{corpus / 'mlruns' / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["vitscale-dedup"], filter_string="tags.`vitscale.stage` = 'dedup'")
    assert sorted(runs["metrics.new_removals"].tolist()) == [0.0, 1.0, 2.0]


def test_dedup_and_prepare_never_write_one_shard_set_at_once(corpus, monkeypatch, reader_process):
    """dedup writes removed.jsonl, its index and report into the shard set, so it takes the set's prepare
    lock; and the rows it removes would leave a run reading the set, so it waits for its readers too."""
    from common import locks
    from common.locks import DataBusy, FolderBusy, FolderLock
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    monkeypatch.setenv("VITSCALE_HOME", str(corpus / "mlruns"))
    shards = corpus / "shards"
    files = {p.relative_to(shards): p.stat().st_mtime_ns for p in shards.rglob("*")}
    with FolderLock(str(shards), "prepare"):
        with pytest.raises(FolderBusy, match=r"another prepare run is writing there \(pid \d+ on "):
            run(DedupConfig(shards=str(shards), test_set=[f"set_a={corpus / 'set_a'}"]))
    with FolderLock(str(shards), "prepare", writer="dedup"):
        with pytest.raises(FolderBusy, match=r"another dedup run is writing there \(pid \d+ on "):
            run_prepare(PrepareConfig(input=[str(corpus / "corpus")], output=str(shards), size=160, workers=1,
                                      shard_mb=0.05))
    monkeypatch.setattr(locks, "READERS_WAIT_S", 0.1)
    with reader_process(shards, "pretrain") as reader:
        with pytest.raises(DataBusy, match=rf"^shards {shards}: this shard set is being read \(pretrain run, pid "
                                           rf"{reader.pid} on .*; dedup would change the data under it: wait"):
            run(DedupConfig(shards=str(shards), test_set=[f"set_a={corpus / 'set_a'}"]))
    assert {p.relative_to(shards): p.stat().st_mtime_ns for p in shards.rglob("*")} == files  # none wrote


def _index_keys(shards: Path, test_set: str):
    from neardup.index import TestSetIndex

    index = TestSetIndex.load(shards / "dedup_index")
    return [k for k, t in zip(index.key, index.test_set) if t == test_set]


def test_config_rejects_a_test_set_without_a_source():
    with pytest.raises(ConfigError, match="test_set"):
        DedupConfig(shards="/data/s", test_set=["cifar10"])


def test_job_rebuilds_an_index_saved_under_other_crop_variants(corpus, monkeypatch, capfd):
    monkeypatch.setenv("VITSCALE_HOME", str(corpus / "mlruns"))
    shards = corpus / "shards"
    cfg = DedupConfig(shards=str(shards), test_set=[f"set_a={corpus / 'set_a'}"])
    run(cfg)
    manifest_path = shards / "dedup_index" / "index.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["crop_variants"] = manifest["crop_variants"][:9]
    manifest_path.write_text(json.dumps(manifest))
    summary = run(cfg)
    [line] = [x for x in capfd.readouterr().err.splitlines() if x.startswith("dedup: ")]
    assert "crop variants" in line and line.endswith("rebuilding it from the test-set sources")
    assert "delete" not in line  # it used to tell the user to do what it was doing
    assert summary["test_images"]["set_a"] == 2
    assert json.loads(manifest_path.read_text())["crop_variants"] != manifest["crop_variants"]


def _copy_with_codes(src: Path, dst: Path, *, zero_codes: bool, signature_version: int | None) -> Path:
    """The shard set at ``src`` copied to ``dst``, its phash codes zeroed if asked, under a manifest version."""
    import hashlib

    import pyarrow as pa
    import pyarrow.ipc as ipc

    dst.mkdir()
    manifest = json.loads((src / MANIFEST).read_text())
    for shard in manifest["shards"]:
        table = ipc.open_file(pa.memory_map(str(src / shard["path"]))).read_all()
        if zero_codes:
            codes = [None if p is None else bytes(len(p)) for p in table.column("phash").to_pylist()]
            i = table.column_names.index("phash")
            table = table.set_column(i, table.schema.field(i), pa.array(codes, pa.binary()))
        with ipc.new_file(str(dst / shard["path"]), table.schema) as writer:
            writer.write_table(table)
        data = (dst / shard["path"]).read_bytes()
        shard.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    if signature_version is None:
        manifest.pop("signature_version", None)
    else:
        manifest["signature_version"] = signature_version
    (dst / MANIFEST).write_text(json.dumps(manifest))
    return dst


@pytest.mark.parametrize("version", [None, 5])
def test_codes_of_another_signature_version_are_recomputed_from_the_stored_images(corpus, tmp_path, monkeypatch,
                                                                                   version):
    from neardup.signatures import SIGNATURE_VERSION

    monkeypatch.setenv("VITSCALE_HOME", str(corpus / "mlruns"))
    assert json.loads((corpus / "shards" / MANIFEST).read_text())["signature_version"] == SIGNATURE_VERSION
    # Codes that match nothing stand in for another version's: they are the same length, so only the
    # manifest's version tells the rescan not to trust them.
    old = _copy_with_codes(corpus / "shards", tmp_path / "old", zero_codes=True, signature_version=version)
    assert run(DedupConfig(shards=str(old), test_set=[f"set_a={corpus / 'set_a'}"]))["new_removals"] == 2
    trusted = _copy_with_codes(corpus / "shards", tmp_path / "now", zero_codes=True,
                               signature_version=SIGNATURE_VERSION)
    assert run(DedupConfig(shards=str(trusted), test_set=[f"set_a={corpus / 'set_a'}"]))["new_removals"] == 0


def test_the_report_keeps_only_the_audited_test_images(tmp_path, photos):
    # Holding every decoded test image for 16 audited pairs cost 2.9 GB against a 10k-image test set.
    from dedup.job import _test_loader
    from pipelines.testsets import iter_images

    for name in ("astronaut.png", "chelsea.png", "coffee.png"):
        photos[name].save(tmp_path / name)
    keys = sorted(it.key for it in iter_images(str(tmp_path)))
    load = _test_loader({"t": str(tmp_path)}, {("t", keys[0])})
    assert load("t", keys[0]) is not None
    assert load("t", keys[1]) is None and load("other", keys[0]) is None


def test_the_job_finds_test_images_cut_mostly_from_each_side_of_a_corpus_photo(tmp_path, photos, tiles, monkeypatch):
    # 10% cut from one side and 2% from the others, then JPEG q90; one side a photo, no miss.
    import random

    from neardup.transforms import _reverse
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    monkeypatch.setenv("VITSCALE_HOME", str(tmp_path / "mlruns"))
    sides = {"left": "astronaut.png", "top": "chelsea.png", "right": "coffee.png", "bottom": "rocket.jpg"}
    (tmp_path / "corpus").mkdir()
    (tmp_path / "cuts").mkdir()
    for i, img in enumerate(tiles[:12:3]):
        img.save(tmp_path / "corpus" / f"distinct_{i}.png")
    for pos, (side, name) in enumerate(sides.items()):
        photos[name].save(tmp_path / "corpus" / Path(name).with_suffix(".png").name)
        box = [0.02] * 4
        box[pos] = 0.1  # left, top, right, bottom
        cut = _reverse(*box, quality=90)(photos[name].convert("RGB"), random.Random(pos))
        cut.save(tmp_path / "cuts" / f"{side}.png")
    run_prepare(PrepareConfig(input=[str(tmp_path / "corpus")], output=str(tmp_path / "shards"), workers=1))

    result = run(DedupConfig(shards=str(tmp_path / "shards"), test_set=[f"cuts={tmp_path / 'cuts'}"]))
    removed = {Path(r["source"]).name: Path(r["test_uri"]).stem for r in _removed(tmp_path / "shards")}
    assert result["new_removals"] == 4, removed
    assert removed == {Path(name).with_suffix(".png").name: side for side, name in sides.items()}
