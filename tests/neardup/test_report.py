import json

from PIL import Image

from neardup.report import caption, counts_table, pick_for_audit, write_report


def _m(key, d):
    return {"key": key, "test_set": "cifar10", "matched_key": f"t{key}", "distance": d, "exact": d == 0}


def test_counts_table_lists_each_test_set():
    table = counts_table({"cifar10": 435, "pets": 600}, {"cifar10": 10000, "pets": 3669}, 1_000_000)
    assert "| cifar10 | 10,000 | 435 |" in table and "| pets | 3,669 | 600 |" in table


def test_audit_picks_closest_and_borderline_pairs():
    matches = [_m(str(i), i) for i in range(30)]
    low, high = pick_for_audit(matches, closest=3, borderline=2)
    assert [m["distance"] for m in low] == [0, 1, 2] and [m["distance"] for m in high] == [28, 29]


def test_report_writes_counts_matches_and_contact_sheet(tmp_path, photos):
    img = photos["astronaut.png"]
    matches = [_m("a", 0), _m("b", 30)]
    paths = write_report(tmp_path, matches, test_images={"cifar10": 5}, corpus_images=100, threshold=32,
                         load_corpus=lambda k: img if k == "a" else None, load_test=lambda t, k: img)
    assert len(paths["matches"].read_text().splitlines()) == 2
    assert "| cifar10 | 5 | 2 |" in paths["counts"].read_text()
    sheet = Image.open(paths["contact_sheet"])
    assert sheet.height >= 2 * 128


def test_captions_and_match_rows_name_both_files(tmp_path, photos):
    m = {**_m("a", 12), "source": "/corpus/photos/2019/IMG_0042.jpg", "test_uri": "/data/pets/test/Abyssinian_1.jpg",
         "direction": "test_in_corpus"}
    text = caption(m, "closest", 28)
    assert "IMG_0042.jpg" in text and "Abyssinian_1.jpg" in text and "test_in_corpus" in text
    assert caption({**m, "source": "s3://b/" + "x" * 300 + "/end.jpg"}, "c", 28).count("end.jpg") == 1
    paths = write_report(tmp_path, [m], test_images={"cifar10": 1}, corpus_images=10, threshold=28,
                         load_corpus=lambda k: photos["coffee.png"], load_test=lambda t, k: None)
    row = json.loads(paths["matches"].read_text())
    assert row["source"] == m["source"] and row["test_uri"] == m["test_uri"]
