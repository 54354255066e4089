"""pipelines.sources.webdataset: WebDataset shards, made here in their real layout, read with their labels."""
from __future__ import annotations

import io
import json
import tarfile
from collections import Counter

import pytest

from pipelines.schema import ShardSet
from pipelines.sources import SourceError, detect_format, iter_items, plan
from pipelines.sources.webdataset import expand_braces


def _shard(path, samples: list[dict[str, bytes]]):
    """A shard as ``webdataset.TarWriter`` writes one: each sample's members in a row, named by key."""
    with tarfile.open(path, "w") as tf:
        for sample in samples:
            for ext, data in sample.items():
                if ext == "__key__":
                    continue
                info = tarfile.TarInfo(f"{sample['__key__']}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def images(photos, enc):
    """Twelve distinct small images: real photos, in JPEG, PNG and WebP."""
    names = sorted(photos)
    fmts = ("JPEG", "PNG", "WEBP")
    return [(("jpg", "png", "webp")[i % 3], enc(photos[names[i % len(names)]].convert("RGB").rotate(i * 7), fmts[i % 3]))
            for i in range(12)]


def _cls_shards(root, images, classes=12, per_shard=4):
    """Shards ``ds-000000.tar`` ... with sample ``i`` in class ``i % classes`` in its ``.cls``."""
    root.mkdir(exist_ok=True)
    for s in range(len(images) // per_shard):
        samples = [{"__key__": f"{i:06d}", ext: data, "cls": str(i % classes).encode()}
                   for i, (ext, data) in enumerate(images) if i // per_shard == s]
        _shard(root / f"ds-{s:06d}.tar", samples)
    return root


def test_cls_samples_are_one_item_each_with_the_integer_label(tmp_path, images):
    root = _cls_shards(tmp_path / "wds", images)
    items = list(iter_items(str(root)))
    assert len(items) == 12 and all(it.error is None for it in items)
    assert [it.labels for it in items] == [(str(i),) for i in range(12)]
    assert [it.read() for it in items] == [data for _, data in images]
    assert items[0].uri.startswith("tar://000000.jpg::file://") and items[0].uri.endswith("ds-000000.tar")


def test_json_labels_by_default_and_by_label_key(tmp_path, images):
    from pipelines.sources import PlanOptions

    samples = [{"__key__": f"s{i}", ext: data, "json": json.dumps({"label": i % 2, "name": ["cat", "dog"][i % 2]}).encode()}
               for i, (ext, data) in enumerate(images[:4])]
    shard = _shard(tmp_path / "j.tar", samples)
    assert [it.labels for it in iter_items(str(shard))] == [("0",), ("1",), ("0",), ("1",)]
    units = plan(str(shard), options=PlanOptions(label_key="name"))
    from pipelines.sources import expand

    assert [it.labels for it in expand(units[0])] == [("cat",), ("dog",), ("cat",), ("dog",)]
    (typo,) = plan(str(shard), options=PlanOptions(label_key="nmae"))
    assert {it.error[0] for it in expand(typo)} == {"bad_label"}
    assert "has no field 'nmae' (it has: label, name); pass one of them as --label-key" in next(expand(typo)).error[1]


def test_sidecars_are_not_items_and_a_sample_without_an_image_is_quarantined(tmp_path, images):
    ext, data = images[0]
    shard = _shard(tmp_path / "x.tar", [
        {"__key__": "a", ext: data, "cls": b"3", "txt": b"a caption"},
        {"__key__": "b", "cls": b"4", "json": b"{}"},
        {"__key__": "c", ext: data, "cls": b"not-a-number"},
        {"__key__": "d", ext: data, "cls": b"-1"},
    ])
    items = list(iter_items(str(shard)))
    assert len(items) == 4
    assert items[0].labels == ("3",) and items[0].error is None
    assert items[1].error[0] == "sample_without_image" and "has: cls, json" in items[1].error[1]
    assert items[2].error[0] == "bad_label" and "--label-key" in items[2].error[1]
    assert items[3].labels == () and items[3].error is None  # -1: the "no label" convention


def test_brace_patterns_and_double_colon_lists_name_the_shards(tmp_path, images):
    root = _cls_shards(tmp_path / "wds", images)
    assert expand_braces("a-{08..11}.tar") == ["a-08.tar", "a-09.tar", "a-10.tar", "a-11.tar"]
    assert len(list(iter_items(f"{root}/ds-{{000000..000002}}.tar"))) == 12
    listed = f"{root}/ds-000000.tar::{root}/ds-000002.tar"
    assert [it.labels[0] for it in iter_items(listed)] == ["0", "1", "2", "3", "8", "9", "10", "11"]
    with pytest.raises(SourceError, match=r"ds-000003.tar: input not found \(named by .*\); check the pattern"):
        plan(f"{root}/ds-{{000000..000003}}.tar")


def test_timm_info_json_splits_choose_the_shards(tmp_path, images):
    from pipelines.sources import PlanOptions

    root = _cls_shards(tmp_path / "wds", images)
    (root / "_info.json").write_text(json.dumps({"name": "toy", "splits": {
        "train": {"name": "train", "num_samples": 8, "filenames": ["ds-000000.tar", "ds-000001.tar"],
                  "shard_lengths": [4, 4]},
        "validation": {"name": "validation", "num_samples": 4, "filenames": ["ds-000002.tar"], "shard_lengths": [4]},
    }}))
    with pytest.raises(SourceError, match="splits train, validation; pass --split NAME"):
        plan(str(root))
    units = plan(str(root), options=PlanOptions(split="validation"))
    assert [u.uris[0].rsplit("/", 1)[-1] for u in units] == ["ds-000002.tar"]


def test_auto_tells_webdataset_shards_from_plain_tars_and_folders(tmp_path, images):
    root = _cls_shards(tmp_path / "wds", images)
    assert detect_format(str(root)) == "webdataset"
    assert detect_format(str(root / "ds-000000.tar")) == "webdataset"
    with tarfile.open(tmp_path / "n01.tar", "w") as tf:  # ImageNet-21k: one flat archive per class
        for i, (ext, data) in enumerate(images[:3]):
            info = tarfile.TarInfo(f"n01_{i}.{ext}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    assert detect_format(str(tmp_path / "n01.tar")) == "tar"


def test_prepare_packs_the_classes_and_counts_that_were_packed(tmp_path, images, prepare, capsys):
    root = _cls_shards(tmp_path / "wds", images)
    ext, data = images[0]
    _shard(root / "ds-000003.tar", [{"__key__": "orphan", "cls": b"5"}])
    manifest = prepare(input=[f"{root}/ds-{{000000..000003}}.tar"], output=str(tmp_path / "out"), size=32,
                       min_short_side=0)
    assert "read as webdataset (auto" in capsys.readouterr().err
    counts = manifest["counts"]
    assert (counts["inputs"], counts["written"], counts["rejected"]) == (13, 12, {"sample_without_image": 1})
    # Numeric order: '10' and '11' come after '9', so each id is the class the .cls file holds.
    assert manifest["label_map"] == {str(i): i for i in range(12)}
    shards = ShardSet(tmp_path / "out")
    ids = Counter(i for batch in shards.iter_batches() for row in batch.to_pylist() for i in row["labels"])
    assert ids == Counter(range(12))


def _info_json(root, train: int):
    (root / "_info.json").write_text(json.dumps({"name": "toy", "splits": {
        "train": {"name": "train", "num_samples": train, "filenames": ["ds-000000.tar", "ds-000001.tar"],
                  "shard_lengths": [4, 4]},
        "validation": {"name": "validation", "num_samples": 4, "filenames": ["ds-000002.tar"], "shard_lengths": [4]},
    }}))


def test_a_split_read_short_of_its_stated_samples_is_one_warning(tmp_path, images, prepare, capsys):
    root = _cls_shards(tmp_path / "wds", images)
    _info_json(root, train=8)
    manifest = prepare(input=[str(root)], output=str(tmp_path / "out"), size=32, split="train", min_short_side=0)
    assert manifest["counts"]["inputs"] == 8 and "_info.json states" not in capsys.readouterr().err
    # One shard of the split truncated to its first sample: 5 read where 8 are stated.
    with tarfile.open(root / "ds-000001.tar") as tf:
        first = [m for m in tf.getmembers() if m.name.startswith("000004.")]
        kept = [(m, tf.extractfile(m).read()) for m in first]
    with tarfile.open(root / "ds-000001.tar", "w") as tf:
        for m, data in kept:
            tf.addfile(m, io.BytesIO(data))
    manifest = prepare(input=[str(root)], output=str(tmp_path / "out2"), size=32, split="train", min_short_side=0)
    assert manifest["counts"]["inputs"] == 5
    lines = [line for line in capsys.readouterr().err.splitlines() if "_info.json states" in line]
    assert len(lines) == 1
    assert lines[0].startswith(f"prepare: warning: {root}: _info.json states 8 samples in split 'train'; 5 were read.")


def test_stated_counts_are_compared_only_when_every_input_states_one():
    from pipelines.ingest import check_stated

    stated = [("/a", "train", 8), ("/b", "train", 4)]
    assert check_stated(stated, ["/a", "/b"], 12) is None
    line = check_stated(stated, ["/a", "/b"], 11)
    assert "/a: _info.json states 8 samples in split 'train'; /b: _info.json states 4" in line
    assert "11 were read" in line and "\n" not in line
    assert check_stated(stated[:1], ["/a", "/c"], 11) is None  # /c states nothing: no total to compare
