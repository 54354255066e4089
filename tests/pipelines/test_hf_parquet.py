"""pipelines.sources.hf_parquet: Parquet files as Hugging Face ``datasets`` writes them, read with their class names."""
from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.schema import ShardSet
from pipelines.sources import PlanOptions, SourceError, detect_format, expand, iter_items, plan

NAMES = ["tench", "goldfish", "shark"]


@pytest.fixture
def images(photos, enc):
    names = sorted(photos)
    return [enc(photos[names[i % len(names)]].convert("RGB").rotate(i * 11), "PNG" if i % 2 else "JPEG")
            for i in range(9)]


def _hf_file(path, images, labels, *, struct=True, names=NAMES, row_group_size=4):
    """A file as ``datasets`` writes one: an Image feature and a ClassLabel, named in the schema metadata."""
    image = ([{"bytes": b, "path": f"{i}.jpg"} for i, b in enumerate(images)] if struct else list(images))
    features = {"image": {"_type": "Image"}, "label": {"names": names, "_type": "ClassLabel"}}
    table = pa.table({"image": image, "label": pa.array(labels, pa.int64())})
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def test_struct_images_take_their_class_label_names(tmp_path, images):
    f = _hf_file(tmp_path / "train-00000-of-00001.parquet", images, [i % 3 for i in range(9)])
    assert detect_format(str(f)) == "hf_parquet"
    units = plan(str(f))
    assert len(units) == 3  # one unit per row group
    items = [it for u in units for it in expand(u)]
    assert [it.labels for it in items] == [(NAMES[i % 3],) for i in range(9)]
    assert [it.read() for it in items] == images
    assert items[5].uri.endswith("train-00000-of-00001.parquet#row=5")


def test_plain_bytes_images_unlabelled_rows_and_a_label_past_the_names(tmp_path, images):
    f = _hf_file(tmp_path / "t.parquet", images[:3], [-1, 1, 7], struct=False)
    items = list(iter_items(str(f)))
    assert items[0].labels == () and items[0].read() == images[0]
    assert items[1].labels == ("goldfish",)
    assert items[2].error[0] == "bad_label" and "past the 3 ClassLabel names" in items[2].error[1]


def test_a_folder_of_splits_needs_split(tmp_path, images):
    _hf_file(tmp_path / "ds" / "data" / "train-00000-of-00002.parquet", images[:4], [0, 1, 2, 0])
    _hf_file(tmp_path / "ds" / "data" / "train-00001-of-00002.parquet", images[4:7], [1, 2, 0])
    _hf_file(tmp_path / "ds" / "data" / "validation-00000-of-00001.parquet", images[7:], [2, 2])
    (tmp_path / "ds" / "README.md").write_text("---\nlicense: mit\n---\n")
    assert detect_format(str(tmp_path / "ds")) == "hf_parquet"
    with pytest.raises(SourceError, match="holds the splits train, validation; pass --split NAME"):
        plan(str(tmp_path / "ds"))
    units = plan(str(tmp_path / "ds"), options=PlanOptions(split="validation"))
    assert [it.labels for u in units for it in expand(u)] == [("shark",), ("shark",)]
    with pytest.raises(SourceError, match="has no split 'test'"):
        plan(str(tmp_path / "ds"), options=PlanOptions(split="test"))


def test_a_uri_manifest_in_parquet_stays_a_manifest(tmp_path, wr, images):
    a = wr(tmp_path / "a.jpg", images[0])
    pq.write_table(pa.table({"uri": [str(a)], "label": ["cat"]}), tmp_path / "m.parquet")
    assert detect_format(str(tmp_path / "m.parquet")) == "manifest"
    assert [it.labels for it in iter_items(str(tmp_path / "m.parquet"))] == [("cat",)]


def test_prepare_keeps_the_datasets_ids_and_counts(tmp_path, images, prepare):
    # ClassLabel order, not name order: goldfish stays 1 though "goldfish" sorts first.
    labels = [i % 3 for i in range(9)]
    _hf_file(tmp_path / "ds" / "train-00000-of-00001.parquet", images, labels)
    manifest = prepare(input=[str(tmp_path / "ds")], output=str(tmp_path / "out"), size=32, min_short_side=0,
                       format="hf-parquet", split="train")
    assert manifest["label_map"] == {"tench": 0, "goldfish": 1, "shark": 2}
    assert (manifest["counts"]["inputs"], manifest["counts"]["written"]) == (9, 9)
    shards = ShardSet(tmp_path / "out")
    ids = Counter(i for batch in shards.iter_batches() for row in batch.to_pylist() for i in row["labels"])
    assert ids == Counter(labels)
