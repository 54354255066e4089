"""pipelines.sources: each source kind enumerates the right items with the right labels."""
from __future__ import annotations

import io
import json
import os
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.decode import BadImage
from pipelines.schema import make_key
from pipelines.sources import SourceError, iter_items, plan


@pytest.fixture
def jpeg(photos, enc):
    return enc(photos["chelsea"], "JPEG")


def _by_name(items):
    return {it.uri.rsplit("/", 1)[-1]: it for it in items}


def test_folder_tree_labels_are_first_level_folders(tmp_path, wr, jpeg):
    wr(tmp_path / "n01" / "a.jpg", jpeg)
    wr(tmp_path / "n02" / "deeper" / "b.jpg", jpeg)
    wr(tmp_path / "loose.jpg", jpeg)
    items = _by_name(iter_items(str(tmp_path)))
    assert items["a.jpg"].labels == ("n01",)
    assert items["b.jpg"].labels == ("n02",)
    assert items["loose.jpg"].labels == ()
    assert items["a.jpg"].read() == jpeg


def test_folder_tree_skips_hidden_files_but_keeps_other_files(tmp_path, wr, jpeg):
    wr(tmp_path / "c" / "a.jpg", jpeg)
    wr(tmp_path / "c" / ".DS_Store", b"junk")
    wr(tmp_path / "c" / "._a.jpg", b"appledouble")
    wr(tmp_path / ".cache" / "x.jpg", jpeg)
    wr(tmp_path / "c" / "notes.txt", b"hello")
    assert sorted(_by_name(iter_items(str(tmp_path)))) == ["a.jpg", "notes.txt"]


def test_enumeration_order_and_keys_are_deterministic(tmp_path, wr, jpeg):
    for i in range(40):
        wr(tmp_path / f"c{i % 3}" / f"{i}.jpg", jpeg)
    first = [(it.uri, it.key) for it in iter_items(str(tmp_path))]
    second = [(it.uri, it.key) for it in iter_items("file://" + str(tmp_path))]
    assert first == second and len(first) == 40
    assert all(key == make_key(uri) for uri, key in first)


def test_names_that_are_not_utf8_are_read_and_recorded_as_text(tmp_path, jpeg):
    # Latin-1 bytes in a class folder and a file name, as in old archives and crawls.
    folder = os.path.join(os.fsencode(tmp_path), b"d\xf6gs")
    os.makedirs(folder)
    with open(os.path.join(folder, b"caf\xe9.jpg"), "wb") as f:
        f.write(jpeg)
    (item,) = iter_items(str(tmp_path))
    assert item.uri.endswith("/d\\xf6gs/caf\\xe9.jpg") and item.labels == ("d\\xf6gs",)
    item.uri.encode("utf-8")  # valid text: Arrow, JSON and UTF-8 files take it
    assert item.read() == jpeg and item.key == make_key(item.uri)


def test_tar_member_names_that_are_not_utf8_are_recorded_as_text(tmp_path, jpeg):
    with tarfile.open(tmp_path / "a.tar", "w", format=tarfile.GNU_FORMAT) as tf:  # GNU: names as raw bytes
        info = tarfile.TarInfo(os.fsdecode(b"n0\xe9/caf\xe9.jpg"))
        info.size = len(jpeg)
        tf.addfile(info, io.BytesIO(jpeg))
    (item,) = iter_items(str(tmp_path / "a.tar"))
    assert item.uri.startswith("tar://n0\\xe9/caf\\xe9.jpg::") and item.labels == ("n0\\xe9",)
    assert item.read() == jpeg


def test_a_manifest_row_in_latin1_opens_its_file_instead_of_failing_the_manifest(tmp_path, jpeg):
    with open(os.path.join(os.fsencode(tmp_path), b"caf\xe9.jpg"), "wb") as f:
        f.write(jpeg)
    (tmp_path / "m.csv").write_bytes(b"uri,label\ncaf\xe9.jpg,caf\xe9\n")
    (tmp_path / "m.jsonl").write_bytes(b'{"uri": "caf\xe9.jpg", "label": "x"}\n')
    for manifest in ("m.csv", "m.jsonl"):
        (item,) = iter_items(str(tmp_path / manifest))
        assert item.uri.endswith("/caf\\xe9.jpg") and item.read() == jpeg
    assert next(iter_items(str(tmp_path / "m.csv"))).labels == ("caf\\xe9",)


def test_files_and_tar_members_above_the_byte_limit_are_not_read(tmp_path, jpeg):
    from pipelines.sources import expand

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "ok.jpg").write_bytes(jpeg)
    (tmp_path / "c" / "video.mp4").write_bytes(bytes(len(jpeg) + 1))
    _tar(tmp_path / "a.tar", {"c/video.mp4": bytes(len(jpeg) + 1), "c/ok.jpg": jpeg})
    for source in (tmp_path / "c", tmp_path / "a.tar"):
        items = [it.materialize() for unit in plan(str(source)) for it in expand(unit, max_bytes=len(jpeg))]
        ok, video = sorted(items, key=lambda it: "video.mp4" in it.uri)
        assert ok.read() == jpeg  # exactly at the limit, and the member after a skipped one
        with pytest.raises(BadImage) as exc:
            video.read()
        assert exc.value.reason == "too_large" and "max_file_mb" in exc.value.detail


def _tar(path, members: dict[str, bytes], mode="w"):
    with tarfile.open(path, mode) as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_tar_per_class_takes_the_archive_stem(tmp_path, jpeg):
    # ImageNet-21k layout: one archive per synset with flat members.
    _tar(tmp_path / "n04399382.tar", {"n04399382_1.JPEG": jpeg, "n04399382_2.JPEG": jpeg})
    items = list(iter_items(str(tmp_path / "n04399382.tar")))
    assert [it.labels for it in items] == [("n04399382",)] * 2
    assert items[0].uri.startswith("tar://n04399382_1.JPEG::file://")
    assert items[0].read() == jpeg


def test_tar_member_folders_are_labels_and_gzip_works(tmp_path, jpeg):
    _tar(tmp_path / "train.tar.gz", {"train/cat/1.jpg": jpeg, "train/dog/2.jpg": jpeg, "./3.jpg": jpeg}, "w:gz")
    labels = {it.uri.split("::")[0]: it.labels for it in iter_items(str(tmp_path / "train.tar.gz"))}
    assert labels == {"tar://train/cat/1.jpg": ("cat",), "tar://train/dog/2.jpg": ("dog",), "tar://3.jpg": ("train",)}


def test_a_tree_tarred_gets_the_classes_the_folder_reader_gives_it(tmp_path, wr, jpeg, caplog, monkeypatch):
    from pipelines.sources import tar

    monkeypatch.setattr(tar, "_said_fallback", False)  # said once per process
    # The first folder level below the root, as the folder reader takes it, not the last.
    tree = {"cat/a.jpg": jpeg, "cat/indoor/b.jpg": jpeg, "dog/c.jpg": jpeg, "loose.jpg": jpeg}
    for name, data in tree.items():
        wr(tmp_path / "tree" / name, data)
    _tar(tmp_path / "tree.tar", {f"tree/{name}": data for name, data in tree.items()})  # tar cf tree.tar tree
    _tar(tmp_path / "flat.tar", {f"./{name}": data for name, data in tree.items()})  # tar cf flat.tar -C tree .

    def by_file(source):
        return {it.uri.split("::")[0].rsplit("/", 1)[-1]: it.labels for it in iter_items(source)}

    folder = by_file(str(tmp_path / "tree"))
    assert folder == {"a.jpg": ("cat",), "b.jpg": ("cat",), "c.jpg": ("dog",), "loose.jpg": ()}
    with caplog.at_level("WARNING", logger="pipelines.sources.tar"):
        for archive, stem in (("tree.tar", "tree"), ("flat.tar", "flat")):
            assert by_file(str(tmp_path / archive)) == {**folder, "loose.jpg": (stem,)}
    assert "sit in no class folder and take the archive's name" in caplog.text


def test_tar_uri_opens_with_fsspec(tmp_path, jpeg):
    import fsspec

    _tar(tmp_path / "n1.tar", {"x.jpg": jpeg})
    (item,) = iter_items(str(tmp_path / "n1.tar"))
    with fsspec.open(item.uri, "rb") as f:
        assert f.read() == jpeg


def test_folder_of_tars(tmp_path, jpeg):
    _tar(tmp_path / "n1.tar", {"a.jpg": jpeg})
    _tar(tmp_path / "n2.tar", {"b.jpg": jpeg})
    assert [it.labels for it in iter_items(str(tmp_path))] == [("n1",), ("n2",)]


def test_corrupt_tar_yields_one_corrupt_archive_item(tmp_path, jpeg):
    good = _tar(tmp_path / "n1.tar", {"a.jpg": jpeg, "b.jpg": jpeg * 20}).read_bytes()
    (tmp_path / "n1.tar").write_bytes(good[: 512 + len(jpeg) + 1024])  # cut inside the second member
    items = list(iter_items(str(tmp_path / "n1.tar")))
    assert items[0].read() == jpeg
    assert items[-1].error[0] == "corrupt_archive"
    with pytest.raises(BadImage, match="corrupt_archive"):
        items[-1].read()


def test_csv_manifest_multi_label_and_relative_uris(tmp_path, wr, jpeg):
    wr(tmp_path / "img" / "a.jpg", jpeg)
    wr(tmp_path / "img" / "b.jpg", jpeg)
    (tmp_path / "m.csv").write_text('uri,labels\nimg/a.jpg,cat|animal\nimg/b.jpg,"[""dog"", ""animal""]"\n')
    items = _by_name(iter_items(str(tmp_path / "m.csv")))
    assert items["a.jpg"].labels == ("cat", "animal")
    assert items["b.jpg"].labels == ("dog", "animal")
    assert items["a.jpg"].read() == jpeg


def test_jsonl_manifest_single_label_absolute_uri_and_bad_rows(tmp_path, wr, jpeg):
    a = wr(tmp_path / "a.jpg", jpeg)
    lines = [json.dumps({"uri": str(a), "label": "cat"}), json.dumps({"label": "dog"}), "{not json"]
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    items = list(iter_items(str(tmp_path / "m.jsonl")))
    assert items[0].labels == ("cat",) and items[0].read() == jpeg
    assert [it.error[0] for it in items[1:]] == ["bad_manifest_row", "bad_manifest_row"]


def test_parquet_manifest_with_list_labels(tmp_path, wr, jpeg):
    a = wr(tmp_path / "x" / "a.jpg", jpeg)
    pq.write_table(pa.table({"uri": [str(a), "x/missing.jpg"], "labels": [["l1", "l2"], []]}), tmp_path / "m.parquet")
    items = list(iter_items(str(tmp_path / "m.parquet")))
    assert items[0].labels == ("l1", "l2")
    assert items[1].labels == () and items[1].error[0] == "unreadable"
    assert "file not found" in items[1].error[1]


def test_manifest_without_uri_column_is_a_source_error(tmp_path):
    (tmp_path / "m.csv").write_text("path,label\na.jpg,x\n")
    with pytest.raises(SourceError, match="no 'uri' column"):
        plan(str(tmp_path / "m.csv"))


def test_missing_source_is_a_source_error(tmp_path):
    with pytest.raises(SourceError, match="input not found"):
        plan(str(tmp_path / "nope"))


def test_memory_filesystem(jpeg):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/srcmem/cls/a.jpg", jpeg)
    (item,) = iter_items("memory://srcmem")
    assert item.labels == ("cls",) and item.read() == jpeg and item.uri.startswith("memory://")


def test_class_folders_that_are_symlinks_are_followed_once(tmp_path, wr, jpeg):
    # Symlinked class folders used to be listed as three files and all quarantined "unreadable".
    real, tree = tmp_path / "real", tmp_path / "tree"
    for cls in ("cat", "dog"):
        wr(real / cls / "a.jpg", jpeg)
        wr(real / cls / "sub" / "b.jpg", jpeg)
    tree.mkdir()
    for cls in ("cat", "dog"):
        (tree / cls).symlink_to(real / cls, target_is_directory=True)
    (real / "dog" / "sub" / "loop").symlink_to(real / "dog", target_is_directory=True)  # a loop: listed once
    items = list(iter_items(str(tree)))
    assert sorted((it.labels, it.uri.rsplit("/", 2)[-2:]) for it in items) == [
        (("cat",), ["cat", "a.jpg"]), (("cat",), ["sub", "b.jpg"]),
        (("dog",), ["dog", "a.jpg"]), (("dog",), ["sub", "b.jpg"]),
    ]
    assert all(it.read() == jpeg for it in items)


def test_a_named_format_reads_the_source_as_that_format_and_an_unknown_one_is_refused(tmp_path, jpeg):
    _tar(tmp_path / "a.tar", {"c/x.jpg": jpeg})
    assert plan(str(tmp_path / "a.tar"), fmt="tar") == plan(str(tmp_path / "a.tar"))
    (unit,) = plan(str(tmp_path / "a.tar"), fmt="files")  # named, the format decides, not the suffix
    assert unit.kind == "files"
    with pytest.raises(SourceError, match="format .wds. is not known; use one of shard_set, webdataset, hf_parquet, folder, imagenet, tar, manifest"):
        plan(str(tmp_path / "a.tar"), fmt="wds")
