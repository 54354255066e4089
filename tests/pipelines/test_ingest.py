"""The prepare pipeline end to end on the real DirectRunner: quarantine, accounting, de-dup, shards."""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.ipc as ipc
import pytest
from PIL import Image

from pipelines.schema import COLUMNS, ShardSet, decode_row_image
from tests.pipelines.imagefiles import encode, write

SIZE = 64






def _rows(out: Path) -> list[dict]:
    return [row for batch in ShardSet(out).iter_batches() for row in batch.to_pylist()]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# A corpus with every kind of good and bad input, ingested once for the module.
GOOD = [
    "a/astronaut.jpg", "a/chelsea.png", "a/coffee.webp", "b/camera.gif", "b/rocket.tiff", "b/china_cmyk.jpg",
    "b/gray16.png", "b/rgba.png", "b/palette.png", "b/rotated.jpg", "c/flower.bmp",
]
BAD = {
    "c/empty.jpg": "empty_file",
    "c/truncated.jpg": "truncated",
    "c/corrupt.gif": "corrupt",
    "c/notes.txt": "not_an_image",
    "c/icon.ico": "unsupported_format",
    "c/bomb.png": "decompression_bomb",
    "c/video.mp4": "too_large",  # above max_file_mb: quarantined without being read whole
    "c/tiny.png": "too_small",
    "c/wide.png": "unexpected_error",  # JPEG cannot store 66000 px: a real encoder exception, dead-lettered
    "broken.tar": "corrupt_archive",
}
CORPUS_DUP = ("a/chelsea_again.bmp", "a/chelsea.png")  # same pixels, different file


@pytest.fixture(scope="module")
def bad_corpus(tmp_path_factory, photos):
    root = tmp_path_factory.mktemp("corpus")
    p = photos
    write(root / "a/astronaut.jpg", encode(p["astronaut"], "JPEG"))
    write(root / "a/chelsea.png", encode(p["chelsea"], "PNG"))
    write(root / "a/chelsea_again.bmp", encode(p["chelsea"], "BMP"))
    write(root / "a/coffee.webp", encode(p["coffee"], "WEBP"))
    write(root / "b/camera.gif", encode(p["camera"], "GIF"))
    write(root / "b/rocket.tiff", encode(p["rocket"], "TIFF"))
    write(root / "b/china_cmyk.jpg", encode(p["china"].convert("CMYK"), "JPEG"))
    ramp = (np.linspace(0, 65535, 100 * 120).reshape(100, 120)).astype(np.uint16)
    write(root / "b/gray16.png", encode(Image.fromarray(ramp), "PNG"))
    write(root / "b/rgba.png", encode(p["retina"].convert("RGBA"), "PNG"))
    write(root / "b/palette.png", encode(p["hubble_deep_field"].convert("P"), "PNG"))
    exif = Image.Exif()
    exif[0x0112] = 6
    write(root / "b/rotated.jpg", encode(p["flower"].rotate(90, expand=True), "JPEG", exif=exif))
    write(root / "c/flower.bmp", encode(p["flower"].transpose(Image.Transpose.FLIP_LEFT_RIGHT), "BMP"))

    write(root / "c/empty.jpg", b"")
    jpg = encode(p["coffee"], "JPEG")
    write(root / "c/truncated.jpg", jpg[: len(jpg) // 2])
    gif = bytearray(encode(p["astronaut"], "GIF"))
    gif[len(gif) // 3: len(gif) // 3 + 400] = np.random.default_rng(0).bytes(400)
    write(root / "c/corrupt.gif", bytes(gif))
    write(root / "c/notes.txt", b"these are not the images you are looking for\n")
    write(root / "c/icon.ico", encode(p["coffee"].resize((64, 64)), "ICO"))
    write(root / "c/bomb.png", encode(Image.new("L", (2000, 2000)), "PNG"))
    write(root / "c/tiny.png", encode(p["coffee"].resize((12, 10)), "PNG"))
    write(root / "c/video.mp4", np.random.default_rng(1).bytes(2_500_000))
    write(root / "c/wide.png", encode(Image.new("RGB", (66000, 17), (10, 200, 30)), "PNG"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("x.jpg")
        info.size = len(jpg)
        tf.addfile(info, io.BytesIO(jpg))
    write(root / "broken.tar", buf.getvalue()[:700])
    return root


@pytest.fixture(scope="module")
def bad_run(bad_corpus, tmp_path_factory, prepare):
    out = tmp_path_factory.mktemp("bad_out")
    manifest = prepare(input=[str(bad_corpus)], output=str(out), size=SIZE, min_short_side=16, max_megapixels=1.5,
                       max_file_mb=2)
    return out, manifest


@pytest.mark.parametrize("name,reason", sorted(BAD.items()))
def test_each_bad_input_is_quarantined_with_its_reason(bad_run, bad_corpus, name, reason):
    out, _ = bad_run
    rows = [r for r in _jsonl(out / "quarantine.jsonl") if r["uri"] == f"file://{bad_corpus / name}"]
    assert [r["reason"] for r in rows] == [reason]
    assert rows[0]["detail"]


def test_dead_letter_keeps_the_exception_text(bad_run):
    out, _ = bad_run
    (row,) = [r for r in _jsonl(out / "quarantine.jsonl") if r["reason"] == "unexpected_error"]
    assert "OSError" in row["detail"] and row["uri"].endswith("wide.png")


def test_counts_reconcile_and_match_the_corpus(bad_run):
    _, manifest = bad_run
    c = manifest["counts"]
    assert c["inputs"] == len(GOOD) + len(BAD) + 1
    assert c["inputs"] == c["written"] + sum(c["rejected"].values()) + sum(c["duplicates"].values())
    assert c["written"] == len(GOOD)
    assert c["rejected"] == {reason: list(BAD.values()).count(reason) for reason in set(BAD.values())}
    assert c["duplicates"] == {"corpus": 1}


def test_exact_duplicate_is_kept_once_and_recorded(bad_run, bad_corpus):
    out, _ = bad_run
    (dup,) = _jsonl(out / "duplicates.jsonl")
    kept = {r["source"]: r["key"] for r in _rows(out)}
    uris = {name: f"file://{bad_corpus / name}" for name in CORPUS_DUP}
    assert dup["cause"] == "corpus"
    # Both files have the same pixels; exactly one is in the shards and the other points at it.
    (kept_uri,) = [u for u in uris.values() if u in kept]
    (dropped_uri,) = [u for u in uris.values() if u not in kept]
    assert dup["uri"] == dropped_uri and dup["duplicate_of"] == kept[kept_uri]


def test_every_good_image_is_resized_and_labelled(bad_run, bad_corpus, photos):
    out, manifest = bad_run
    rows = {r["source"].split(str(bad_corpus) + "/")[1]: r for r in _rows(out)}
    assert set(rows) | set(CORPUS_DUP) == set(GOOD) | set(CORPUS_DUP) and len(rows) == len(GOOD)
    names = {v: k for k, v in manifest["label_map"].items()}
    for name, row in rows.items():
        assert min(row["height"], row["width"]) == SIZE, name
        assert [names[i] for i in row["labels"]] == [name.split("/")[0]]
        assert decode_row_image(row).shape == (row["height"], row["width"], 3)
    # EXIF orientation: the stored file is rotated, the shard row is upright like the original.
    flower = photos["flower"]
    assert (rows["b/rotated.jpg"]["width"] > rows["b/rotated.jpg"]["height"]) == (flower.width > flower.height)


def test_shards_are_arrow_ipc_files_with_the_schema_columns(bad_run):
    out, manifest = bad_run
    for shard in manifest["shards"]:
        with open(out / shard["path"], "rb") as f:
            table = ipc.open_file(f).read_all()
        assert set(COLUMNS) <= set(table.column_names)
        assert table.num_rows == shard["rows"]
        keys = table.column("key").to_pylist()
        assert keys == sorted(keys)


def test_run_is_tracked_in_mlflow(bad_run):
    from common import tracking

    _, manifest = bad_run
    run = tracking.get_run(manifest["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    assert m["inputs"] == manifest["counts"]["inputs"] and m["written"] == manifest["counts"]["written"]
    assert m["rejected.too_small"] == 1 and m["images_per_s"] > 0
    assert m["beam.inputs"] == manifest["counts"]["inputs"]
    import mlflow

    arts = {a.path for a in mlflow.MlflowClient(tracking.tracking_uri()).list_artifacts(run.info.run_id)}
    assert {"manifest.json", "quarantine.jsonl", "duplicates.jsonl"} <= arts


def test_rerun_gives_identical_outputs(bad_run, bad_corpus, prepare):
    out, manifest = bad_run
    before = {name: (out / name).read_bytes() for name in ("quarantine.jsonl", "duplicates.jsonl")}
    again = prepare(input=[str(bad_corpus)], output=str(out), size=SIZE, min_short_side=16, max_megapixels=1.5,
                    max_file_mb=2)
    assert again["shards"] == manifest["shards"]
    assert again["counts"] == manifest["counts"] and again["label_map"] == manifest["label_map"]
    assert {name: (out / name).read_bytes() for name in before} == before
    ShardSet(out).verify()


# -- round trip: raw storage returns exactly the pixels that went in --------------------------

def test_round_trip_is_exact_and_verified(tmp_path, photos, prepare):
    src = tmp_path / "src"
    expected = {}
    for i, name in enumerate(["astronaut", "chelsea", "coffee", "rocket", "china"]):
        path = write(src / f"img{i}.png", encode(photos[name], "PNG"))
        expected[f"file://{path}"] = (np.asarray(photos[name]), [name, "photo"] if i % 2 else [name])
    lines = [json.dumps({"uri": uri, "labels": labels}) for uri, (_, labels) in expected.items()]
    (src / "m.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    # A size above every image: nothing is resized, so the stored pixels are the input pixels.
    manifest = prepare(input=[str(src / "m.jsonl")], output=str(out), size=1000, store="raw")
    ss = ShardSet(out)
    ss.verify()
    assert len(ss) == len(expected) == manifest["counts"]["written"]
    names = ss.label_names
    for i in range(len(ss)):
        row = ss[i]
        pixels, labels = expected[row["source"]]
        assert row["format"] == "raw"
        np.testing.assert_array_equal(decode_row_image(row), pixels)
        assert sorted(names[j] for j in row["labels"]) == sorted(labels)


def test_never_upscales_unless_asked_and_caps_the_long_side(tmp_path, photos, prepare):
    src = tmp_path / "src"
    write(src / "small.png", encode(photos["coffee"].resize((50, 40)), "PNG"))
    write(src / "pano.png", encode(photos["china"].resize((400, 100)), "PNG"))
    out = prepare(input=[str(src)], output=str(tmp_path / "o1"), size=SIZE, max_long_side=128, min_short_side=0)
    sizes = {Path(r["source"]).name: (r["width"], r["height"]) for r in _rows(tmp_path / "o1")}
    assert sizes == {"small.png": (50, 40), "pano.png": (128, 32)}
    assert out["counts"]["written"] == 2
    prepare(input=[str(src)], output=str(tmp_path / "o2"), size=SIZE, upscale=True, min_short_side=0)
    sizes = {Path(r["source"]).name: (r["width"], r["height"]) for r in _rows(tmp_path / "o2")}
    assert sizes == {"small.png": (80, 64), "pano.png": (256, 64)}


# -- other sources, labels and sharding --------------------------------------------------------

def test_tars_and_multi_label_manifest_with_label_map(tmp_path, photos, prepare):
    jpg = {n: encode(photos[n], "JPEG") for n in ("astronaut", "chelsea", "coffee", "rocket")}
    for synset, names in {"n01": ["astronaut", "chelsea"], "n02": ["coffee"]}.items():
        with tarfile.open(tmp_path / f"{synset}.tar", "w") as tf:
            for n in names:
                info = tarfile.TarInfo(f"{synset}_{n}.JPEG")
                info.size = len(jpg[n])
                tf.addfile(info, io.BytesIO(jpg[n]))
    write(tmp_path / "m" / "r.jpg", jpg["rocket"])
    write(tmp_path / "m" / "c.jpg", encode(photos["china"], "JPEG"))
    (tmp_path / "m" / "labels.csv").write_text("uri,labels\nr.jpg,n01|n02\nc.jpg,n01|mystery\n")
    (tmp_path / "lm.json").write_text(json.dumps({"n01": 7, "n02": 3}))
    out = tmp_path / "out"
    manifest = prepare(
        input=[str(tmp_path / "n01.tar"), str(tmp_path / "n02.tar"), str(tmp_path / "m" / "labels.csv")],
        output=str(out), size=SIZE, label_map=str(tmp_path / "lm.json"),
    )
    assert manifest["label_map"] == {"n01": 7, "n02": 3}
    assert manifest["counts"]["rejected"] == {"unknown_label": 1}
    labels = {r["source"].split("::")[0].rsplit("/", 1)[-1]: r["labels"] for r in _rows(out)}
    assert labels == {"n01_astronaut.JPEG": [7], "n01_chelsea.JPEG": [7], "n02_coffee.JPEG": [3], "r.jpg": [3, 7]}
    (q,) = _jsonl(out / "quarantine.jsonl")
    assert q["uri"].endswith("c.jpg") and "mystery" in q["detail"]


def test_reshard_an_existing_shard_set_to_a_smaller_size(tmp_path, photos, prepare):
    src = tmp_path / "src"
    for n in ("astronaut", "chelsea", "coffee"):
        write(src / n[0] / f"{n}.png", encode(photos[n], "PNG"))
    first = prepare(input=[str(src)], output=str(tmp_path / "s1"), size=SIZE, store="raw")
    second = prepare(input=[str(tmp_path / "s1")], output=str(tmp_path / "s2"), size=32)
    a = {r["key"]: r for r in _rows(tmp_path / "s1")}
    b = {r["key"]: r for r in _rows(tmp_path / "s2")}
    assert set(a) == set(b) and second["counts"]["written"] == first["counts"]["written"] == 3
    assert second["label_map"] == first["label_map"]
    for key in a:
        assert b[key]["source"] == a[key]["source"] and b[key]["labels"] == a[key]["labels"]
        assert min(b[key]["height"], b[key]["width"]) == 32


def test_removed_keys_are_skipped_by_the_reader(tmp_path, photos, prepare):
    src = tmp_path / "src"
    for n in ("astronaut", "chelsea", "coffee", "rocket"):
        write(src / "x" / f"{n}.png", encode(photos[n], "PNG"))
    prepare(input=[str(src)], output=str(tmp_path / "o"), size=32, shard_mb=0.002)
    full = ShardSet(tmp_path / "o")
    keys = [r["key"] for r in _rows(tmp_path / "o")]
    gone = keys[1::2]
    (tmp_path / "o" / "removed.jsonl").write_text("".join(json.dumps({"key": k, "reason": "test"}) + "\n" for k in gone))
    ss = ShardSet(tmp_path / "o")
    assert len(full) == 4 and len(ss) == 2
    assert [ss[i]["key"] for i in range(len(ss))] == [k for k in keys if k not in gone]
    assert [r["key"] for r in _rows(tmp_path / "o")] == [k for k in keys if k not in gone]
    ss.verify()  # removal does not touch the shard files
    # A re-shard from it drops the removed rows for good.
    m = prepare(input=[str(tmp_path / "o")], output=str(tmp_path / "o2"), size=32)
    assert m["counts"]["inputs"] == 2


@pytest.fixture(scope="module")
def many(tmp_path_factory, photos, noisy_copies):
    return noisy_copies(tmp_path_factory.mktemp("many"), photos, 36, classes=4, class_prefix="class", spread=20, seed=0)


def test_sharding_is_deterministic_across_worker_counts(many, tmp_path, prepare):
    one = prepare(input=[str(many)], output=str(tmp_path / "w1"), size=SIZE, shard_mb=0.03, workers=1)
    two = prepare(input=[str(many)], output=str(tmp_path / "w2"), size=SIZE, shard_mb=0.03, workers=2)
    assert len(one["shards"]) > 1
    assert one["shards"] == two["shards"]
    keys = [r["key"] for r in _rows(tmp_path / "w1")]
    assert len(keys) == len(set(keys)) == 36


def test_memory_filesystem_input_and_output(photos, prepare):
    import fsspec

    fs = fsspec.filesystem("memory")
    for n in ("astronaut", "chelsea"):
        fs.pipe(f"/memsrc/k/{n}.png", encode(photos[n], "PNG"))
    manifest = prepare(input=["memory://memsrc"], output="memory://memout", size=32)
    assert manifest["counts"]["written"] == 2
    ss = ShardSet("memory://memout")
    ss.verify()
    assert {Path(ss[i]["source"]).name for i in range(len(ss))} == {"astronaut.png", "chelsea.png"}


def test_memory_filesystem_with_worker_processes_is_refused_up_front(photos, tmp_path):
    import fsspec

    from pipelines.config import PrepareConfig
    from pipelines.ingest import PrepareError, run_prepare

    fsspec.filesystem("memory").pipe("/memsrc2/k/a.png", encode(photos["astronaut"], "PNG"))
    for cfg in (PrepareConfig(input=["memory://memsrc2"], output=str(tmp_path / "o"), workers=2),
                PrepareConfig(input=[str(tmp_path)], output="memory://memout2", workers=2)):
        with pytest.raises(PrepareError, match="memory:// exists only inside this process.*--workers 1"):
            run_prepare(cfg)
    assert not (tmp_path / "o").exists()


# -- test-set de-duplication (paper Sec. 4.1) --------------------------------------------------

def test_planted_copies_of_test_images_are_dropped(tmp_path, photos, prepare):
    test_a, test_b, corpus = tmp_path / "test_a", tmp_path / "test_b", tmp_path / "corpus"
    write(test_a / "t" / "astronaut.png", encode(photos["astronaut"], "PNG"))
    write(test_a / "t" / "chelsea.png", encode(photos["chelsea"], "PNG"))
    write(test_b / "t" / "coffee.png", encode(photos["coffee"], "PNG"))
    write(corpus / "x" / "astronaut_copy.png", encode(photos["astronaut"], "PNG"))  # exact
    small = photos["chelsea"].resize((photos["chelsea"].width * 3 // 5, photos["chelsea"].height * 3 // 5))
    write(corpus / "x" / "chelsea_small.png", encode(small, "PNG"))  # resized
    write(corpus / "x" / "coffee_q70.jpg", encode(photos["coffee"], "JPEG", quality=70))  # re-encoded
    for n in ("rocket", "retina", "china", "flower", "camera", "hubble_deep_field"):
        write(corpus / "y" / f"{n}.png", encode(photos[n], "PNG"))
    out = tmp_path / "out"
    manifest = prepare(input=[str(corpus)], output=str(out), size=SIZE,
                       test_set=[f"setA={test_a}", f"setB={test_b}"])
    c = manifest["counts"]
    assert c["duplicates"] == {"corpus": 0, "setA": 2, "setB": 1}
    assert c["written"] == 6 and c["inputs"] == 9
    dups = {Path(d["uri"]).name: d for d in _jsonl(out / "duplicates.jsonl")}
    assert set(dups) == {"astronaut_copy.png", "chelsea_small.png", "coffee_q70.jpg"}
    assert dups["astronaut_copy.png"]["test_set"] == "setA" and dups["astronaut_copy.png"]["exact"] is True
    assert dups["coffee_q70.jpg"]["test_set"] == "setB"
    assert all({"key", "uri", "test_set", "test_key", "distance"} <= set(d) for d in dups.values())
    assert Path(dups["coffee_q70.jpg"]["test_uri"]).name == "coffee.png"  # the test file, by its uri
    assert {Path(r["source"]).parent.name for r in _rows(out)} == {"y"}


def test_isolated_decoder_gives_the_same_shards(tmp_path, photos, prepare):
    src = tmp_path / "src"
    for n in ("astronaut", "chelsea"):
        write(src / "k" / f"{n}.png", encode(photos[n], "PNG"))
    write(src / "k" / "bad.png", b"\x89PNG\r\n\x1a\n broken")
    plain = prepare(input=[str(src)], output=str(tmp_path / "a"), size=32)
    isolated = prepare(input=[str(src)], output=str(tmp_path / "b"), size=32, isolate_decoder=True)
    assert isolated["shards"] == plain["shards"] and isolated["counts"] == plain["counts"]
    assert plain["counts"]["rejected"] == {"corrupt": 1}


def test_exact_copies_are_removed_across_many_shards_and_workers(tmp_path, photos, prepare):
    # Lossless copies in three formats and three class folders: identical decoded pixels, different
    # keys. Rows are sharded by content, so each image's copies meet in one shard writer.
    src = tmp_path / "copies"
    names = ["astronaut", "chelsea", "coffee", "rocket", "china", "flower"]
    for n in names:
        for cls, fmt in (("a", "PNG"), ("b", "BMP"), ("c", "TIFF")):
            write(src / cls / f"{n}.{fmt.lower()}", encode(photos[n].convert("RGB"), fmt))
    manifest = prepare(input=[str(src)], output=str(tmp_path / "o"), size=48, shard_mb=0.004, workers=2)
    c = manifest["counts"]
    assert len(manifest["shards"]) > 1
    assert c["inputs"] == 18 and c["written"] == 6 and c["duplicates"] == {"corpus": 12}
    rows = _rows(tmp_path / "o")
    assert len({r["content_hash"] for r in rows}) == 6
    keys = {r["key"] for r in rows}
    dups = _jsonl(tmp_path / "o" / "duplicates.jsonl")
    assert len(dups) == 12 and all(d["duplicate_of"] in keys and d["key"] not in keys for d in dups)
    by_content = {}
    for d in dups:
        by_content.setdefault(d["duplicate_of"], []).append(d["key"])
    assert all(len(v) == 2 and min(v) > kept for kept, v in by_content.items())  # the smallest key is kept


# -- the accounting check and the one re-run ---------------------------------------------------

def _lose_one_record(monkeypatch, tmp_path: Path, attempts_that_lose: int) -> Path:
    """Make the shuffle to the shard writers drop a record, as the runner once did, for the first N runs.

    Beam serialises the step, so the runs are counted in a file (one line each), not in memory.
    """
    from pipelines import shard_writer

    real, log = shard_writer.write_shard, tmp_path / "shard-writer-runs.txt"

    def lossy(group, *args):
        index, records = group
        records = sorted(records)  # packed spill.Refs, which start with the key
        if index == 0:
            with open(log, "a") as f:
                f.write("run\n")
            if len(log.read_text().splitlines()) <= attempts_that_lose:
                records = records[1:]
        yield from real((index, records), *args)

    monkeypatch.setattr(shard_writer, "write_shard", lossy)
    return log


@pytest.mark.parametrize("workers", [1, 2])
def test_a_record_lost_in_the_shuffle_is_caught_and_the_pipeline_run_again(tmp_path, photos, prepare, monkeypatch,
                                                                           caplog, workers):
    import mlflow

    from common import tracking

    src, out = tmp_path / "src", tmp_path / "out"
    for name in ("astronaut", "chelsea", "coffee", "rocket"):
        write(src / "x" / f"{name}.png", encode(photos[name], "PNG"))
    runs = _lose_one_record(monkeypatch, tmp_path, attempts_that_lose=1)
    manifest = prepare(input=[str(src)], output=str(out), size=SIZE, workers=workers)
    assert len(runs.read_text().splitlines()) == 2 and manifest["attempts"] == 2
    # The multi-worker DirectRunner is the one seen losing data; the second attempt runs in one process.
    assert ("running the pipeline again in one process" in caplog.text) == (workers > 1)
    assert manifest["counts"]["inputs"] == manifest["counts"]["written"] == 4
    ShardSet(out).verify()
    assert not list(out.glob(".staging-*"))
    client = mlflow.MlflowClient(tracking.tracking_uri())
    run_id = manifest["mlflow_run_id"]
    assert client.get_run(run_id).data.metrics["attempts"] == 2
    failed = client.download_artifacts(run_id, "failed_attempt_1/outputs.jsonl", str(tmp_path))
    shard_rows = [r for r in _jsonl(Path(failed)) if r["_t"] == "shard"]
    assert [r["received"] for r in shard_rows] == [3]


def test_a_mismatch_on_every_attempt_fails_loudly_and_writes_no_manifest(tmp_path, photos, prepare, monkeypatch):
    from pipelines.ingest import MAX_ATTEMPTS, AccountingError

    src, out = tmp_path / "src", tmp_path / "out"
    for name in ("astronaut", "chelsea"):
        write(src / "x" / f"{name}.png", encode(photos[name], "PNG"))
    _lose_one_record(monkeypatch, tmp_path, attempts_that_lose=MAX_ATTEMPTS)
    with pytest.raises(AccountingError) as err:
        prepare(input=[str(src)], output=str(out), size=SIZE)
    message = str(err.value)
    assert "inputs (2) != written (1) + rejected (0) + duplicates (0)" in message
    assert "2 records went into the shuffle to the shard writers and 1 came out of it" in message
    assert f"after {MAX_ATTEMPTS} attempts" in message
    assert not (out / "manifest.json").exists()
    assert len(list(out.glob(".staging-*/outputs.jsonl"))) == 1  # the last attempt's, for the report
