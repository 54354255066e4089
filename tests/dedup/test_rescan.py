"""dedup.rescan reads shard sets through pipelines.schema.ShardSet, with its checks."""
import json

import pytest

from neardup.index import TestSetIndex
from dedup.rescan import rescan
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
