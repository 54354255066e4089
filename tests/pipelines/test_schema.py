"""pipelines.schema: the reader's checks and the training decode helper."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from pipelines.schema import (
    MANIFEST,
    SCHEMA,
    SCHEMA_VERSION,
    ShardSet,
    ShardSetError,
    decode_row_image,
    make_key,
    text_uri,
)


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory, photos, prepare):
    src = tmp_path_factory.mktemp("src")
    for n in ("astronaut", "chelsea", "coffee", "rocket"):
        (src / n[:2]).mkdir()
        photos[n].save(src / n[:2] / f"{n}.png")
    out = tmp_path_factory.mktemp("out")
    prepare(input=[str(src)], output=str(out), size=48, shard_mb=0.004)
    return out


def test_schema_carries_its_version():
    assert SCHEMA.metadata[b"vitscale.schema_version"] == str(SCHEMA_VERSION).encode()


def test_random_access_matches_streaming(shard_set):
    ss = ShardSet(shard_set)
    streamed = [row for batch in ss.iter_batches() for row in batch.to_pylist()]
    assert len(ss.shards) > 1 and len(streamed) == len(ss) == ss.manifest["num_rows"]
    assert [ss[i] for i in range(len(ss))] == streamed
    assert ss[-1] == streamed[-1]
    with pytest.raises(IndexError):
        ss[len(ss)]


def test_open_shard_is_memory_mapped(shard_set):
    import pyarrow as pa

    before = pa.total_allocated_bytes()
    table = ShardSet(shard_set).open_shard(0)
    # Zero-copy from the mapped file: opening a shard allocates no Arrow memory for its rows.
    assert pa.total_allocated_bytes() - before < table.nbytes // 4
    assert table.schema.equals(SCHEMA, check_metadata=False)


def test_verify_names_the_shard_and_both_checksums(shard_set, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shard_set, copy)
    ShardSet(copy).verify()
    first = ShardSet(copy).shards[0]
    path = copy / first["path"]
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardSetError) as e:
        ShardSet(copy).verify()
    msg = str(e.value)
    assert msg.startswith(f"{first['path']}: sha256 mismatch (manifest says {first['sha256'][:12]}")
    assert "re-run prepare" in msg


@pytest.mark.parametrize("bad", ["../x", "../../etc/passwd", "sub/../../x", "/etc/passwd", "..\\x",
                                 "C:\\x.arrow", "file:///etc/passwd", "", None])
def test_a_manifest_cannot_name_a_shard_outside_its_directory(shard_set, tmp_path, bad):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shard_set, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["shards"][0]["path"] = bad
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardSetError) as e:
        ShardSet(copy)
    assert f"shard path {bad!r} is not a relative path inside the shard set" in str(e.value)
    assert str(copy) in str(e.value)


def test_sha256_is_checked_on_read_when_asked(shard_set, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shard_set, copy)
    ss = ShardSet(copy, verify=True)
    assert len(list(ss.iter_batches())) >= len(ss.shards)  # intact shards read as usual
    second = ss.shards[1]
    path = copy / second["path"]
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    ShardSet(copy).open_shard(0)  # not asked: no hashing, and an intact shard reads fine
    ss = ShardSet(copy, verify=True)
    ss.open_shard(0)
    with pytest.raises(ShardSetError, match=rf"^{second['path']}: sha256 mismatch .*re-run prepare"):
        ss.open_shard(1)
    with pytest.raises(ShardSetError, match="sha256 mismatch"):
        list(ShardSet(copy, verify=True).iter_batches())


def test_missing_manifest_is_a_clear_error(tmp_path):
    with pytest.raises(ShardSetError, match="no manifest.json"):
        ShardSet(tmp_path)


def test_newer_schema_version_is_refused(shard_set, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shard_set, copy)
    m = json.loads((copy / MANIFEST).read_text())
    m["schema_version"] = SCHEMA_VERSION + 1
    (copy / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ShardSetError, match="schema_version"):
        ShardSet(copy)


def test_bad_removed_list_names_the_line(shard_set, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shard_set, copy)
    (copy / "removed.jsonl").write_text('{"key": "abc"}\n[1, 2]\n')
    with pytest.raises(ShardSetError, match="removed.jsonl:2"):
        ShardSet(copy)


def test_shard_set_pickles_without_open_tables(shard_set):
    import pickle

    ss = ShardSet(shard_set)
    row = ss[0]
    assert pickle.loads(pickle.dumps(ss))[0] == row


def test_decode_row_image_raw_and_jpeg(photos):
    arr = np.asarray(photos["coffee"])
    h, w = arr.shape[:2]
    out = decode_row_image(arr.tobytes(), "raw", h, w)
    np.testing.assert_array_equal(out, arr)
    assert out.flags.writeable
    buf = io.BytesIO()
    photos["coffee"].save(buf, "JPEG", quality=95)
    row = {"image": buf.getvalue(), "format": "jpeg", "height": h, "width": w}
    jpg = decode_row_image(row)
    assert jpg.shape == (h, w, 3) and jpg.dtype == np.uint8 and np.abs(jpg.astype(int) - arr).mean() < 4
    gray = io.BytesIO()
    photos["camera"].save(gray, "JPEG")
    assert decode_row_image(gray.getvalue(), "jpeg").shape[2] == 3


def test_decode_row_image_rejects_inconsistent_rows():
    with pytest.raises(ValueError, match="needs"):
        decode_row_image(b"\x00" * 10, "raw", 2, 2)
    with pytest.raises(ValueError, match="unknown format"):
        decode_row_image(b"", "png", 1, 1)


def test_text_uri_escapes_only_what_is_not_utf8_and_keys_ignore_the_form():
    import os

    raw = os.fsdecode(b"/c/caf\xe9.jpg")  # how Python hands over a Latin-1 file name
    assert text_uri(raw) == "/c/caf\\xe9.jpg"
    assert text_uri("/c/猫 x.jpg") == "/c/猫 x.jpg"  # valid names are untouched, so keys never moved
    assert text_uri("a\ud800b") == "a\\ud800b"  # a lone surrogate from a JSON escape
    assert make_key(raw) == make_key(text_uri(raw))


def test_an_image_folder_given_as_a_shard_set_gets_a_prepare_command_that_works(tmp_path, photos, enc, prepare):
    # The hint used to be "prepare --output <that same folder>", which prepare refuses (output inside input).
    import re

    folder = tmp_path / "pics"
    for name in ("chelsea", "coffee"):
        (folder / "cat").mkdir(parents=True, exist_ok=True)
        (folder / "cat" / f"{name}.png").write_bytes(enc(photos[name], "PNG"))
    with pytest.raises(ShardSetError) as err:
        ShardSet(folder)
    match = re.search(r"jobs/prepare.py --input (\S+) --output (\S+), then pass (\S+)$", str(err.value))
    assert match and match[1] == str(folder) and match[2] == match[3] == f"{folder}-shards", str(err.value)
    prepare(input=[match[1]], output=match[2], size=32)
    assert len(ShardSet(match[3])) == 2
