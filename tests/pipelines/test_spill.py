"""Spill files on a real filesystem: images out and back by (file, offset, length)."""
from __future__ import annotations

import os

import pytest

from pipelines.spill import BLOB, DIR, Blobs, Ref, SpillImages, SpillRecords


def _spill(staging: str, images: list[bytes], bundles: int) -> list[dict]:
    fn = SpillImages(staging)
    fn.setup()
    out = []
    per = -(-len(images) // bundles)
    for b in range(bundles):
        fn.start_bundle()
        for i, image in enumerate(images[b * per:(b + 1) * per]):
            out += fn.process({"key": f"k{b}-{i}", "image": image, "format": "jpeg"})
        fn.finish_bundle()
    fn.teardown()
    return out


def test_images_come_back_exactly_in_any_order(tmp_path):
    images = [os.urandom(n) for n in (0, 1, 5000, 70_000, 3, 123_456)]
    records = _spill(str(tmp_path), images, bundles=2)
    assert all("image" not in r and r["format"] == "jpeg" for r in records)
    assert len(list((tmp_path / DIR).iterdir())) == 2  # one file per bundle
    with Blobs(str(tmp_path)) as blobs:
        assert [blobs.read(r[BLOB]) for r in records] == images
        order = [4, 0, 5, 2, 1, 3]
        assert blobs.read_many([records[i][BLOB] for i in order]) == [images[i] for i in order]


def test_more_files_than_the_reader_keeps_open(tmp_path):
    images = [os.urandom(100 + i) for i in range(80)]
    records = _spill(str(tmp_path), images, bundles=80)
    with Blobs(str(tmp_path)) as blobs:
        assert blobs.read_many([r[BLOB] for r in reversed(records)]) == images[::-1]


def test_a_truncated_spill_file_is_an_error_naming_it(tmp_path):
    [record] = _spill(str(tmp_path), [b"x" * 1000], bundles=1)
    name = record[BLOB][0]
    path = tmp_path / DIR / name
    path.write_bytes(path.read_bytes()[:10])
    with Blobs(str(tmp_path)) as blobs, pytest.raises(OSError, match=name):
        blobs.read(record[BLOB])


def test_memory_filesystem(tmp_path):
    images = [b"a" * 10, b"b" * 20]
    records = _spill("memory://spill-test/staging", images, bundles=1)
    with Blobs("memory://spill-test/staging") as blobs:
        assert blobs.read_many([r[BLOB] for r in records]) == images


def test_a_record_comes_back_whole_from_the_ref_that_crosses_the_shuffle(tmp_path):
    fn = SpillRecords(str(tmp_path))
    fn.setup()
    fn.start_bundle()
    record = {"_t": "record", "key": "0a1b", "content_hash": "ff" * 32, "uri": "/data/caf\udce9/x.jpg",
              "labels": ("cat", "pet"), "format": "jpeg", "height": 3, "width": 4, "phash": bytes(range(112)),
              "image": os.urandom(5000)}
    [packed] = list(fn.process(dict(record)))
    fn.finish_bundle()
    assert isinstance(packed, str) and len(packed) < 160  # what the runner holds per record
    with Blobs(str(tmp_path)) as blobs:
        [(image, fields)] = blobs.read_records([Ref.unpack(packed)])
    assert image == record["image"]
    assert fields == {**{k: v for k, v in record.items() if k != "image"}, "labels": ["cat", "pet"]}
