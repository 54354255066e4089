"""dedup.rescan reads shard sets through pipelines.schema.ShardSet, with its checks."""
import json

import pytest

from dedup.rescan import rescan
from neardup.index import TestSetIndex
from pipelines.schema import MANIFEST, SCHEMA_VERSION, ShardSetError


def _empty_shard_set(root):
    root.mkdir()
    (root / MANIFEST).write_text(json.dumps({"schema_version": SCHEMA_VERSION, "shards": [], "num_rows": 0,
                                             "label_map": {}}))
    return root


def test_a_folder_that_is_not_a_shard_set_is_named(tmp_path):
    with pytest.raises(ShardSetError, match=f"{tmp_path}: no {MANIFEST}"):
        rescan(tmp_path, TestSetIndex())


def test_a_shard_set_of_another_schema_version_is_refused(tmp_path):
    root = _empty_shard_set(tmp_path / "s")
    (root / MANIFEST).write_text(json.dumps({"schema_version": SCHEMA_VERSION + 1, "shards": []}))
    with pytest.raises(ShardSetError, match=f"schema_version {SCHEMA_VERSION + 1}"):
        rescan(root, TestSetIndex())


def test_a_malformed_removal_list_is_named_by_line(tmp_path):
    root = _empty_shard_set(tmp_path / "s")
    (root / "removed.jsonl").write_text('{"key": "a"}\n{"key": \n')
    with pytest.raises(ShardSetError, match=r"removed.jsonl:2: not valid JSON"):
        rescan(root, TestSetIndex())


def test_a_torn_last_line_is_skipped_by_readers_and_repaired_by_the_next_rescan(tmp_path, caplog):
    from pipelines.schema import ShardSet, read_removed

    root = _empty_shard_set(tmp_path / "s")
    removed = root / "removed.jsonl"
    removed.write_text('{"key": "a"}\n{"key": "b", "test_set": "t"}\n{"key": "c", "test_se')
    assert read_removed(root) == {"a", "b"}
    assert "torn" in caplog.text
    assert len(ShardSet(root)) == 0  # the set opens; no hand edit needed
    rescan(root, TestSetIndex())
    assert removed.read_text() == '{"key": "a"}\n{"key": "b", "test_set": "t"}\n'


def test_removals_are_written_whole_through_a_rename(tmp_path):
    from pipelines.schema import append_removed

    root = _empty_shard_set(tmp_path / "s")
    append_removed(root, [{"key": "a"}])
    before = (root / "removed.jsonl").stat().st_ino
    append_removed(root, [{"key": "b"}, {"key": "c"}])
    # A new file renamed over the old one (a new inode), never bytes appended to a file a reader may hold.
    assert (root / "removed.jsonl").stat().st_ino != before
    assert (root / "removed.jsonl").read_text() == '{"key": "a"}\n{"key": "b"}\n{"key": "c"}\n'
    assert sorted(p.name for p in root.iterdir()) == ["manifest.json", "removed.jsonl"]
