"""ImageNet-1k's own layouts, made by the test: the train archive (a tar of per-class tars) and the
validation folder with its label files."""
from __future__ import annotations

import io
import tarfile

import pytest

from pipelines.schema import ShardSet
from pipelines.sources import READERS, iter_items, plan

# Out of order on purpose: class ids follow the sorted WNIDs, not the archive's order.
WNIDS = ("n01484850", "n01440764", "n01443537")
PER_CLASS = 3


def _add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def _class_tar(wnid: str, images: list[bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as inner:
        for i, data in enumerate(images):
            _add(inner, f"{wnid}_{10026 + i}.JPEG", data)
    return buf.getvalue()


@pytest.fixture(scope="module")
def class_images(photos):
    from tests.pipelines.imagefiles import encode

    names = sorted(photos)
    out = {}
    for c, wnid in enumerate(WNIDS):
        out[wnid] = [encode(photos[names[(c * PER_CLASS + i) % len(names)]].convert("RGB")
                            .rotate(7 * i + c), "JPEG") for i in range(PER_CLASS)]
    return out


def _train_archive(path, class_images, mode="w") -> str:
    with tarfile.open(path, mode) as outer:
        for wnid in WNIDS:
            _add(outer, f"{wnid}.tar", _class_tar(wnid, class_images[wnid]))
    return str(path)


@pytest.mark.parametrize("name,mode,units", [("ILSVRC2012_img_train.tar", "w", 3), ("train.tar.gz", "w:gz", 1)])
def test_the_train_archive_is_read_member_by_member_labelled_by_its_inner_tars(tmp_path, class_images, name, mode,
                                                                               units):
    src = _train_archive(tmp_path / name, class_images, mode)
    planned = plan(src)
    assert len(planned) == units and {u.kind for u in planned} == {"imagenet"}  # one unit per class when seekable
    items = list(iter_items(src))
    assert len(items) == len(WNIDS) * PER_CLASS and all(i.error is None for i in items)
    for item in items:
        wnid = item.labels[0]
        assert item.labels == (wnid,) and f"tar://{wnid}_" in item.uri and f"::tar://{wnid}.tar::" in item.uri
    assert sorted(i.data for i in items) == sorted(d for images in class_images.values() for d in images)


def test_a_plain_tar_of_images_is_still_the_tar_reader(tmp_path, class_images):
    path = tmp_path / "n01440764.tar"
    path.write_bytes(_class_tar("n01440764", class_images["n01440764"]))
    assert {u.kind for u in plan(str(path))} == {"tar"} and "imagenet" in READERS


def test_prepare_ingests_the_train_archive_with_sorted_wnid_ids(tmp_path, class_images, prepare):
    # It used to give "6 inputs -> 0 written, 6 quarantined" with exit 0.
    src = _train_archive(tmp_path / "ILSVRC2012_img_train.tar", class_images)
    manifest = prepare(input=[src], output=str(tmp_path / "out"), size=32)
    assert manifest["counts"]["written"] == len(WNIDS) * PER_CLASS and manifest["counts"]["rejected_total"] == 0
    assert manifest["label_map"] == {w: i for i, w in enumerate(sorted(WNIDS))}
    shards = ShardSet(tmp_path / "out")
    names = shards.label_names
    for i in range(len(shards)):
        row = shards[i]
        (label,) = row["labels"]
        assert f"::tar://{names[label]}.tar::" in row["source"]
