"""Both directions of the match rule: test images cut from corpus photos, and the files named."""
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from neardup import signatures as sig
from neardup.index import FORWARD, INNER_THRESHOLD_OFFSET, REVERSE, TestSetIndex
from neardup.transforms import REVERSE_TRANSFORMS, apply
from tests.conftest import new_home

PHOTOS = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "china.jpg", "motorcycle_left.png"]
UNRELATED = ["retina.jpg", "camera.png", "flower.jpg", "hubble_deep_field.jpg", "coins.png"]


def _codes(img):
    return np.frombuffer(sig.corpus_codes(img), dtype=np.uint8).reshape(sig.CORPUS_CODES, sig.SIGNATURE_BYTES)


def test_corpus_codes_start_with_the_whole_image_code(photos):
    img = photos["astronaut.png"]
    codes = sig.corpus_codes(img)
    assert len(codes) == sig.CORPUS_SIGNATURE_BYTES and codes[: sig.SIGNATURE_BYTES] == sig.compute(img)
    assert sig.split_codes(codes) == [codes[i: i + 16] for i in range(0, sig.CORPUS_SIGNATURE_BYTES, 16)]
    with pytest.raises(ValueError, match="corpus_codes"):
        sig.split_codes(b"x" * 17)


@pytest.mark.parametrize("transform", sorted(REVERSE_TRANSFORMS))
def test_corpus_photos_whose_crop_became_a_test_image_are_found(photos, transform):
    index = TestSetIndex()
    for i, name in enumerate(PHOTOS):
        index.add("bench", name, apply(transform, photos[name], seed=i), source=f"/test/{name}")
    found = []
    for name in PHOTOS:
        matches = index.match(sig.content_hash(photos[name]), sig.corpus_codes(photos[name]))
        assert all(m.key == name for m in matches), (transform, name, matches)  # never another photo
        if matches:
            assert matches[0].uri == f"/test/{name}"
            found.append(name)
    # every side of the one-side cuts included: no miss allowed
    assert set(found) == set(PHOTOS), (transform, found)


@pytest.mark.parametrize("side", range(4))
def test_a_test_image_cut_mostly_from_one_side_is_found_whichever_side(photos, side):
    # 10% from one side, 2% from the others, JPEG q90: a code aimed at each side (INNER_CROPS)
    import random

    from neardup.transforms import _reverse

    box = [0.02] * 4
    box[side] = 0.1
    index = TestSetIndex()
    for name in PHOTOS + UNRELATED:
        index.add("bench", name, _reverse(*box, quality=90)(photos[name].convert("RGB"), random.Random(0)))
    for name in PHOTOS + UNRELATED:
        matches = index.match("", sig.corpus_codes(photos[name]))
        assert [m.key for m in matches] == [name] and matches[0].direction == REVERSE, (side, name, matches)


def test_three_percent_crops_the_issue_planted_are_found_in_reverse(photos):
    # 3%-per-side crops, resized to 256 px, JPEG q75: the forward-only rule missed them at distances 28..42
    from neardup.transforms import _reverse

    index = TestSetIndex()
    cut = _reverse(0.03, 0.03, 0.03, 0.03, 75)
    import random

    for name in PHOTOS[:3]:
        index.add("bench", name, cut(photos[name], random.Random(0)))
    for name in PHOTOS[:3]:
        (m,) = index.match("", sig.corpus_codes(photos[name]))
        assert m.key == name and m.direction == REVERSE


def test_unrelated_photos_are_not_found_in_either_direction(photos, tiles):
    index = TestSetIndex()
    for i, name in enumerate(PHOTOS):
        for transform in sorted(REVERSE_TRANSFORMS):
            index.add("bench", f"{name}/{transform}", apply(transform, photos[name], seed=i))
    queries = np.stack([_codes(photos[n]) for n in UNRELATED] + [_codes(t) for t in tiles[::6]])
    item, rec, dist, code = index.search_corpus(queries)
    assert item.size == 0, [(int(i), index.key[r], int(d)) for i, r, d in zip(item, rec, dist)]


def _random_index_and_queries(rng, records: int, items: int):
    """An index of ``records`` random test records (every crop variant) at 32 bits, their codes,
    and ``items`` random corpus items' codes to plant near copies in."""
    index = TestSetIndex(threshold=32)
    codes = rng.integers(0, 256, (records, len(sig.CROP_VARIANTS), sig.SIGNATURE_BYTES), dtype=np.uint8)
    for i in range(len(codes)):
        index.add("rand", f"k{i}", content_hash=f"h{i}", codes=codes[i])
    return index, codes, rng.integers(0, 256, (items, sig.CORPUS_CODES, sig.SIGNATURE_BYTES), dtype=np.uint8)


def test_search_corpus_is_exact_for_the_rule_in_both_directions():
    rng = np.random.default_rng(1)
    index, codes, queries = _random_index_and_queries(rng, 2000, 200)
    for r in range(100):  # near copies of a variant, planted in either code, 0..40 bits away
        slot, target, variant = r % sig.CORPUS_CODES, rng.integers(len(codes)), rng.integers(codes.shape[1])
        bits = np.unpackbits(codes[target, variant])
        bits[rng.choice(sig.CODE_BITS, rng.integers(0, 41), replace=False)] ^= 1
        queries[r, slot] = np.packbits(bits)
    fast = index.search_corpus(queries)
    slow = index.search_corpus(queries, brute=True)
    assert len(fast[0]) > 30
    assert all(np.array_equal(a, b) for a, b in zip(fast, slow))
    assert set(fast[3].tolist()) == set(range(sig.CORPUS_CODES))


def test_one_record_lookup_reports_what_the_batch_search_reports_over_all_pairs():
    # match() (the ingest's lookup, record by record) picks each record's closest code on its
    # own path; it must agree with the rule evaluated over all pairs, code and distance included,
    # where an item reaches one record through several codes at distances a tie could confuse.
    rng = np.random.default_rng(2)
    index, codes, queries = _random_index_and_queries(rng, 1500, 60)
    for r in range(60):  # every item near 1..3 records, through 1..4 of its codes, 0..34 bits away
        for target in rng.choice(len(codes), rng.integers(1, 4), replace=False):
            for slot in rng.choice(sig.CORPUS_CODES, rng.integers(1, 5), replace=False):
                bits = np.unpackbits(codes[target, rng.integers(codes.shape[1])])
                bits[rng.choice(sig.CODE_BITS, rng.integers(0, 35), replace=False)] ^= 1
                queries[r, slot] = np.packbits(bits)
    for r in range(10):  # ties: the whole-image code exactly INNER_THRESHOLD_OFFSET bits further than an inner one
        target = codes[rng.integers(len(codes)), 0]
        for slot, far in ((0, 3 + INNER_THRESHOLD_OFFSET), (1 + r % 6, 3)):
            bits = np.unpackbits(target)
            bits[rng.choice(sig.CODE_BITS, far, replace=False)] ^= 1
            queries[r, slot] = np.packbits(bits)
    item, rec, dist, code = index.search_corpus(queries, brute=True)
    want = {i: [] for i in range(len(queries))}
    for i, r, d, c in zip(item.tolist(), rec.tolist(), dist.tolist(), code.tolist()):
        want[i].append((d, index.key[r], REVERSE if c else FORWARD))
    for i in range(len(queries)):
        got = [(m.distance, m.key, m.direction) for m in index.match("", queries[i].tobytes())]
        assert got == sorted(want[i]), i
    assert sum(map(len, want.values())) > 60 and {c > 0 for c in code.tolist()} == {False, True}


def test_forward_matches_report_their_direction(photos):
    index = TestSetIndex()
    index.add("bench", "coffee", photos["coffee.png"], source="/t/coffee.png")
    copy = apply("crop_10_left", photos["coffee.png"])
    (m,) = index.match(sig.content_hash(copy), sig.corpus_codes(copy))
    assert m.direction == FORWARD and m.uri == "/t/coffee.png"
    # a bare whole-image signature (shards before version 3) still matches forward
    assert index.match("", sig.compute(copy))[0].key == "coffee"


# -- the job: a shard set built under the previous rule ---------------------------------------

@pytest.fixture(scope="module", params=[2, 3, 4])
def old_shards(request, tmp_path_factory, photos):
    """An ingest output as signature version 2 (whole-image phash only), 3 (whole image and one
    inner crop) or 4 (two inner crops, cut from the full image) left it, with its dedup state
    under that rule."""
    version = request.param
    root = tmp_path_factory.mktemp(f"dedup_rev_v{version}")
    (root / "corpus").mkdir()
    (root / "tests").mkdir()
    for name in ("rocket.jpg", "china.jpg", "retina.jpg"):
        photos[name].save(root / "corpus" / Path(name).with_suffix(".png").name)
    apply("reverse_crop_5_all_q50", photos["rocket.jpg"]).save(root / "tests" / "rocket_cut.png")
    apply("reverse_crop_2_all_q75", photos["coffee.png"]).save(root / "tests" / "coffee_cut.png")
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare
    from pipelines.schema import file_sha256

    mp = pytest.MonkeyPatch()
    mp.setenv("VITSCALE_HOME", str(new_home(root / "mlruns")))
    run_prepare(PrepareConfig(input=[str(root / "corpus")], output=str(root / "shards"), size=160, workers=1))
    mp.undo()
    shards = root / "shards"
    manifest = json.loads((shards / "manifest.json").read_text())
    kept = sig.SIGNATURE_BYTES * (version - 1)  # version 2 wrote one code, version 3 two, version 4 three
    for entry in manifest["shards"]:
        path = shards / entry["path"]
        table = ipc.open_file(pa.BufferReader(path.read_bytes())).read_all()  # not mapped: rewritten below
        i = table.schema.get_field_index("phash")
        old = pa.array([p[:kept] for p in table.column(i).to_pylist()], table.schema.field(i).type)
        table = table.set_column(i, table.schema.field(i), old)
        with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        # The older ingest wrote its own manifest: the checksums match the shards it wrote.
        entry["sha256"], entry["bytes"] = file_sha256(path), path.stat().st_size
    (shards / "manifest.json").write_text(json.dumps(manifest))
    from pipelines.testsets import build_test_set_index

    fingerprint = build_test_set_index({"cuts": str(root / "tests")}).fingerprint("cuts")
    state = {"format": 1, "signature_version": version, "threshold": 28, "rule": "0123456789abcdef",
             "shards": {e["sha256"]: {"path": e["path"], "test_sets": {"cuts": fingerprint}}
                        for e in manifest["shards"]}}
    (shards / "dedup_state.json").write_text(json.dumps(state))
    return root, version


def test_a_shard_set_checked_under_the_previous_rule_is_rechecked_once(old_shards, monkeypatch):
    from dedup.job import DedupConfig, run

    old_shards, version = old_shards
    monkeypatch.setenv("VITSCALE_HOME", str(old_shards / "mlruns"))
    shards = old_shards / "shards"
    cfg = DedupConfig(shards=str(shards), test_set=[f"cuts={old_shards / 'tests'}"])
    first = run(cfg)
    assert first["rule_changed"] == f"signature version {version} -> {sig.SIGNATURE_VERSION}"
    assert "match rule changed" in first["message"] and first["shards_checked"] == first["shards_total"]
    (row,) = [json.loads(line) for line in (shards / "removed.jsonl").read_text().splitlines()]
    assert Path(row["source"]).name == "rocket.png" and Path(row["test_uri"]).name == "rocket_cut.png"
    assert row["direction"] == REVERSE and row["test_set"] == "cuts" and row["key"] and row["matched_key"]
    matches = (shards / "dedup_report" / "matches.jsonl").read_text()
    assert "rocket_cut.png" in matches and "rocket.png" in matches

    second = run(cfg)
    assert second["nothing_new"] and second["rule_changed"] is None and "nothing new" in second["message"]
    assert len((shards / "removed.jsonl").read_text().splitlines()) == 1


def test_low_texture_images_match_by_content_hash_only(photos):
    from dedup.calibration import low_texture_pool

    low = [img for _, img in low_texture_pool(n=8)]
    assert all(sig.texture_margin(img) < sig.LOW_TEXTURE_MARGIN for img in low)
    assert sig.texture_margin(photos["coins.png"]) > sig.LOW_TEXTURE_MARGIN
    assert sig.corpus_codes(low[1]) == b"" and len(sig.variant_codes(low[1])) == 0
    index = TestSetIndex()
    for i, img in enumerate(low):
        index.add("low", str(i), img)
    # another gradient or flat colour, and a re-encoded copy, are not matched; an identical copy is
    for img in low_texture_pool(n=8, seed=1):
        assert index.match(sig.content_hash(img[1]), sig.corpus_codes(img[1])) == []
    q30 = apply("jpeg_q30", low[1])
    assert index.match(sig.content_hash(q30), sig.corpus_codes(q30)) == []
    (m,) = index.match(sig.content_hash(low[1].copy()), sig.corpus_codes(low[1]))
    assert m.exact and m.key == "1"
