import json
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from neardup import signatures as sig
from neardup.index import IndexOutdated, TestSetIndex


def _random_index(n=3000, seed=0, threshold=32):
    rng = np.random.default_rng(seed)
    index = TestSetIndex(threshold=threshold)
    codes = rng.integers(0, 256, (n, len(sig.CROP_VARIANTS), sig.SIGNATURE_BYTES), dtype=np.uint8)
    for i in range(n):
        index.add("rand", f"k{i}", content_hash=f"h{i}", codes=codes[i])
    return index, codes, rng


def test_search_returns_exactly_what_brute_force_returns():
    index, codes, rng = _random_index()
    queries = rng.integers(0, 256, (300, sig.SIGNATURE_BYTES), dtype=np.uint8)
    bits = np.unpackbits(codes[:150, 3], axis=1)  # near copies of a crop variant, 0..40 bits away
    for r in range(150):
        flip = rng.choice(sig.CODE_BITS, rng.integers(0, 41), replace=False)
        bits[r, flip] ^= 1
    queries[:150] = np.packbits(bits, axis=1)
    got = sorted(zip(*(a.tolist() for a in index.search(queries, chunk=64))))
    want = sorted(zip(*(a.tolist() for a in index.brute_force(queries))))
    assert got == want
    assert len(want) > 50  # the planted ones within the rule are there to be found


def test_exact_copy_matches_by_content_hash(photos):
    index = TestSetIndex()
    img = photos["coffee.png"]
    index.add("photos", "coffee", img)
    [m] = index.match(sig.content_hash(img), sig.compute(img))
    assert m.exact and m.distance == 0 and (m.test_set, m.key) == ("photos", "coffee")
    assert index.exact(sig.content_hash(img)) == [0] and index.exact(sig.content_hash(photos["chelsea.png"])) == []


def test_index_survives_pickling_as_a_side_input(photos):
    index = TestSetIndex()
    index.add("photos", "rocket", photos["rocket.jpg"])
    index.match("x", sig.compute(photos["rocket.jpg"]))  # builds the bucket tables
    clone = pickle.loads(pickle.dumps(index))
    assert clone.match("x", sig.compute(photos["rocket.jpg"]))[0].key == "rocket"


def test_save_load_is_incremental_and_tagged(tmp_path, photos):
    index = TestSetIndex()
    index.add("a", "astronaut", photos["astronaut.png"])
    index.add("b", "chelsea", photos["chelsea.png"])
    index.save(tmp_path)
    again = TestSetIndex.load(tmp_path)
    assert again.add("a", "astronaut", photos["astronaut.png"]) is False
    assert again.add("a", "coffee", photos["coffee.png"]) is True
    again.save(tmp_path)
    manifest = json.loads((tmp_path / "index.json").read_text())
    assert sorted((f["test_set"], f["version"], f["rows"]) for f in manifest["files"]) == [
        ("a", 1, 1), ("a", 2, 1), ("b", 1, 1)]
    with pa.memory_map(str(tmp_path / "a.v2.arrow")) as src:
        meta = ipc.open_file(src).schema.metadata
    assert meta[b"test_set"] == b"a" and meta[b"version"] == b"2"
    loaded = TestSetIndex.load(tmp_path)
    assert loaded.counts() == {"a": 2, "b": 1} and loaded.versions == {"a": 2, "b": 1}
    copy = photos["coffee.png"].resize((300, 200))
    assert loaded.match(sig.content_hash(copy), sig.compute(copy))[0].key == "coffee"


def test_an_index_saves_and_loads_in_a_folder_whose_name_is_not_utf8(tmp_path, photos):
    import os
    from pathlib import Path

    d = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"ind\xe9x")))  # Latin-1 bytes, as Python hands them over
    index = TestSetIndex()
    index.add("a", "astronaut", photos["astronaut.png"])
    index.save(d)
    assert TestSetIndex.load(d).counts() == {"a": 1}


def test_threshold_outside_the_code_is_rejected():
    with pytest.raises(ValueError, match="threshold"):
        TestSetIndex(threshold=sig.CODE_BITS)


def test_an_index_saved_under_other_crop_variants_is_refused(tmp_path, photos):
    index = TestSetIndex()
    index.add("a", "astronaut", photos["astronaut.png"])
    index.save(tmp_path)
    manifest = json.loads((tmp_path / "index.json").read_text())
    manifest["crop_variants"] = manifest["crop_variants"][:9]
    (tmp_path / "index.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexOutdated, match="crop variants"):
        TestSetIndex.load(tmp_path)


def test_rule_id_changes_with_the_threshold():
    assert TestSetIndex(threshold=20).rule_id() != TestSetIndex(threshold=21).rule_id()
    assert TestSetIndex(threshold=20).rule_id() == TestSetIndex(threshold=20).rule_id()
