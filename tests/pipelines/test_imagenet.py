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


# The validation folder: ILSVRC2012_val_00000001.JPEG ... and its classes, by file.
VAL_CLASSES = ("n01443537", "n01440764", "n01484850", "n01440764", "n01484850", "n01443537")
SYNSETS = ("n01440764", "n01443537", "n01484850")  # ILSVRC ids 1, 2, 3 (not sorted-WNID order in real data)


@pytest.fixture(scope="module")
def val_folder(tmp_path_factory, class_images):
    root = tmp_path_factory.mktemp("val")
    folder = root / "val"
    folder.mkdir()
    for n, wnid in enumerate(VAL_CLASSES, 1):
        (folder / f"ILSVRC2012_val_{n:08d}.JPEG").write_bytes(class_images[wnid][n % PER_CLASS])
    rows = [f"ILSVRC2012_val_{n:08d},{w} 10 20 110 120 n09999999 1 2 3 4" for n, w in enumerate(VAL_CLASSES, 1)]
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "\n".join(reversed(rows)) + "\n")
    (root / "ground_truth.txt").write_text("".join(f"{SYNSETS.index(w) + 1}\n" for w in VAL_CLASSES))
    (root / "synsets.txt").write_text("n01440764 tench, Tinca tinca\nn01443537 goldfish\nn01484850 great white\n")
    return root


def _planned_labels(root, **kw) -> dict[str, tuple]:
    from pipelines.config import PrepareConfig
    from pipelines.ingest import plan_inputs

    units = plan_inputs(PrepareConfig(input=[str(root / "val")], output=str(root / "out"), workers=1, **kw))
    return {uri.rsplit("/", 1)[1]: labels for u in units for uri, labels in zip(u.uris, u.labels)}


def _expected() -> dict[str, tuple]:
    return {f"ILSVRC2012_val_{n:08d}.JPEG": (w,) for n, w in enumerate(VAL_CLASSES, 1)}


def test_a_validation_folder_takes_its_labels_from_each_label_file(val_folder):
    import numpy as np
    import scipy.io

    assert _planned_labels(val_folder, labels=str(val_folder / "LOC_val_solution.csv")) == _expected()
    assert _planned_labels(val_folder, labels=str(val_folder / "ground_truth.txt"),
                           synsets=str(val_folder / "synsets.txt")) == _expected()
    # The devkit's meta.mat: the classes are its leaf synsets (no children), in ILSVRC id order.
    synsets = np.array([(3, "n01484850", 0), (1, "n01440764", 0), (4, "n00000001", 3), (2, "n01443537", 0)],
                       dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O"), ("num_children", "O")])
    scipy.io.savemat(val_folder / "meta.mat", {"synsets": synsets})
    assert _planned_labels(val_folder, labels=str(val_folder / "ground_truth.txt"),
                           synsets=str(val_folder / "meta.mat")) == _expected()


def test_a_label_file_that_does_not_fit_the_folder_is_refused_in_one_line(val_folder, tmp_path):
    from pipelines.config import PrepareError

    with pytest.raises(PrepareError, match=r"labels: .*ground_truth.txt is not LOC_val_solution.csv; a ground-truth "
                                           r"file of ids needs --synsets"):
        _planned_labels(val_folder, labels=str(val_folder / "ground_truth.txt"))
    short = tmp_path / "short.csv"
    short.write_text("\n".join((val_folder / "LOC_val_solution.csv").read_text().splitlines()[:-1]) + "\n")
    with pytest.raises(PrepareError, match=r"labels: 1 of 6 unlabelled files have no label in .*short.csv, e.g. "):
        _planned_labels(val_folder, labels=str(short))
    (tmp_path / "gt.txt").write_text("1\n2\n")
    with pytest.raises(PrepareError, match=r"gt.txt has 2 lines but the input has 6 unlabelled files"):
        _planned_labels(val_folder, labels=str(tmp_path / "gt.txt"), synsets=str(val_folder / "synsets.txt"))


def test_prepare_ingests_the_validation_folder_with_sorted_wnid_ids(val_folder, prepare):
    # It used to ingest every row unlabelled, with exit 0.
    manifest = prepare(input=[str(val_folder / "val")], output=str(val_folder / "out"), size=32,
                       labels=str(val_folder / "LOC_val_solution.csv"))
    assert manifest["counts"]["written"] == len(VAL_CLASSES)
    assert manifest["label_map"] == {w: i for i, w in enumerate(sorted(SYNSETS))}
    shards = ShardSet(val_folder / "out")
    expected = _expected()
    for i in range(len(shards)):
        row = shards[i]
        assert (shards.label_names[row["labels"][0]],) == expected[row["source"].rsplit("/", 1)[1]]


def test_prepare_reads_the_train_archive_inside_a_folder_input(tmp_path, class_images, prepare):
    # The folder reader used to read it as one plain tar: its class tars quarantined, labelled with its name.
    folder = tmp_path / "imagenet"
    folder.mkdir()
    _train_archive(folder / "ILSVRC2012_img_train.tar", class_images)
    manifest = prepare(input=[str(folder)], output=str(tmp_path / "out"), size=32)
    assert manifest["counts"]["written"] == len(WNIDS) * PER_CLASS and manifest["counts"]["rejected_total"] == 0
    assert manifest["label_map"] == {w: i for i, w in enumerate(sorted(WNIDS))}
    shards = ShardSet(tmp_path / "out")
    for i in range(len(shards)):
        row = shards[i]
        assert f"::tar://{shards.label_names[row['labels'][0]]}.tar::" in row["source"]


@pytest.fixture(scope="module")
def val_tar(val_folder):
    """ImageNet's validation set as it downloads: ILSVRC2012_img_val.tar, a flat tar of the JPEGs."""
    path = val_folder / "tar" / "ILSVRC2012_img_val.tar"
    path.parent.mkdir()
    with tarfile.open(path, "w") as archive:
        for f in sorted((val_folder / "val").iterdir()):
            _add(archive, f.name, f.read_bytes())
    return path


def _member_labels(val_folder, val_tar, **kw) -> dict[str, tuple]:
    from pipelines.config import PrepareConfig
    from pipelines.ingest import plan_inputs
    from pipelines.sources import expand

    units = plan_inputs(PrepareConfig(input=[str(val_tar)], output=str(val_folder / "out-tar"), workers=1, **kw))
    return {item.uri.split("::")[0].rsplit("/", 1)[1]: item.labels for u in units for item in expand(u)}


def test_a_flat_tar_takes_its_members_labels_from_each_label_file(val_folder, val_tar):
    assert _member_labels(val_folder, val_tar, labels=str(val_folder / "LOC_val_solution.csv")) == _expected()
    assert _member_labels(val_folder, val_tar, labels=str(val_folder / "ground_truth.txt"),
                          synsets=str(val_folder / "synsets.txt")) == _expected()
    # Without --labels its members still take the archive's name, as one archive per class does.
    assert set(_member_labels(val_folder, val_tar).values()) == {("ILSVRC2012_img_val",)}


def test_a_label_file_missing_a_tar_member_is_refused_in_one_line(val_folder, val_tar, tmp_path):
    from pipelines.config import PrepareError

    short = tmp_path / "short.csv"
    short.write_text("\n".join((val_folder / "LOC_val_solution.csv").read_text().splitlines()[:-1]) + "\n")
    with pytest.raises(PrepareError, match=r"labels: 1 of 6 unlabelled files have no label in .*short.csv, e.g. "
                                           r"tar://ILSVRC2012_val_00000001.JPEG::"):
        _member_labels(val_folder, val_tar, labels=str(short))


def test_prepare_ingests_the_validation_tar_with_sorted_wnid_ids(val_folder, val_tar, prepare):
    manifest = prepare(input=[str(val_tar)], output=str(val_folder / "out-tar"), size=32,
                       labels=str(val_folder / "LOC_val_solution.csv"))
    assert manifest["counts"]["written"] == len(VAL_CLASSES) and manifest["counts"]["rejected_total"] == 0
    assert manifest["label_map"] == {w: i for i, w in enumerate(sorted(SYNSETS))}
    shards = ShardSet(val_folder / "out-tar")
    expected = _expected()
    for i in range(len(shards)):
        row = shards[i]
        member = row["source"].split("::")[0].rsplit("/", 1)[1]
        assert (shards.label_names[row["labels"][0]],) == expected[member]


def test_a_tarred_validation_folder_takes_its_labels_from_the_label_file(val_folder, tmp_path):
    # `tar cf val.tar val/`: its members sit in the tarred folder, not in class folders named "val".
    path = tmp_path / "val.tar"
    with tarfile.open(path, "w") as archive:
        archive.add(val_folder / "val", arcname="val")
    assert _member_labels(val_folder, path, labels=str(val_folder / "LOC_val_solution.csv")) == _expected()
