"""pipelines.labels: integer labels keep their meaning, with and without a label map."""
from __future__ import annotations

from collections import Counter

from pipelines.labels import default_label_map, names_by_id, renumbered, resolve
from pipelines.schema import ShardSet


def test_integer_names_are_ordered_by_value_and_other_names_as_text():
    assert default_label_map([str(i) for i in (11, 2, 0, 10, 1)]) == {"0": 0, "1": 1, "2": 2, "10": 3, "11": 4}
    assert default_label_map(["b", "10", "a", "2"]) == {"10": 0, "2": 1, "a": 2, "b": 3}


def test_integer_labels_with_a_missing_id_are_named_as_renumbered():
    assert renumbered(default_label_map(["0", "1", "2"])) == []
    assert renumbered(default_label_map(["0", "2", "3"])) == ["2", "3"]
    assert renumbered(default_label_map(["cat", "dog"])) == []


def test_an_integer_label_is_the_name_of_that_id_in_a_map_of_names():
    label_map = {"cat": 0, "dog": 1}
    assert resolve(("1", "cat", "7"), label_map, names_by_id(label_map)) == ("dog", "cat", "7")
    numeric = {"0": 0, "1": 1}  # a map of integer names is matched by name
    assert resolve(("1",), numeric, names_by_id(numeric)) == ("1",)


def test_a_manifest_of_class_ids_with_a_names_file(tmp_path, photos, enc, prepare, caplog):
    names = sorted(photos)
    rows = ["uri,label"]
    for i in range(12):
        path = tmp_path / "img" / f"{i}.png"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(enc(photos[names[i % len(names)]].convert("RGB").rotate(i * 13), "PNG"))
        rows.append(f"img/{i}.png,{i % 11}")  # ids 0..10; 0 twice
    (tmp_path / "m.csv").write_text("\n".join(rows) + "\n")
    out = prepare(input=[str(tmp_path / "m.csv")], output=str(tmp_path / "ids"), size=32, min_short_side=0)
    assert out["label_map"] == {str(i): i for i in range(11)}  # '10' after '9', not after '1'

    (tmp_path / "names.txt").write_text("\n".join(f"class{i}" for i in range(10)) + "\n")  # no name for id 10
    named = prepare(input=[str(tmp_path / "m.csv")], output=str(tmp_path / "named"), size=32, min_short_side=0,
                    label_map=str(tmp_path / "names.txt"))
    assert named["label_map"] == {f"class{i}": i for i in range(10)}
    assert named["counts"]["rejected"] == {"unknown_label": 1}
    ids = Counter(i for batch in ShardSet(tmp_path / "named").iter_batches() for row in batch.to_pylist()
                  for i in row["labels"])
    assert ids == Counter([0, 0, *range(1, 10)])

    (tmp_path / "gap.csv").write_text("uri,label\nimg/0.png,0\nimg/1.png,2\n")  # no image of class 1
    with caplog.at_level("WARNING", logger="pipelines.ingest"):
        gap = prepare(input=[str(tmp_path / "gap.csv")], output=str(tmp_path / "gap"), size=32, min_short_side=0)
    assert gap["label_map"] == {"0": 0, "2": 1}
    assert "the integer labels 2 got the ids 1" in caplog.text and "--label-map FILE" in caplog.text
