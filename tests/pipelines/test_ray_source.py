"""pipelines.ray_source: Ray Data streams exactly the reader's rows, one read task per shard.

Ray comes from the suite-wide ``ray_session`` fixture (tests/conftest.py): one Ray per test session.
"""
from __future__ import annotations

import json


def test_read_shards_streams_the_shard_set(ray_session, tmp_path, photos, prepare):
    from pipelines.ray_source import read_shards
    from pipelines.schema import ShardSet

    src = tmp_path / "src"
    for n in ("astronaut", "chelsea", "coffee", "rocket", "retina"):
        (src / n[:3]).mkdir(parents=True)
        photos[n].save(src / n[:3] / f"{n}.png")
    prepare(input=[str(src)], output=str(tmp_path / "out"), size=32, shard_mb=0.003)
    ss = ShardSet(tmp_path / "out")
    removed = ss[0]["key"]
    (tmp_path / "out" / "removed.jsonl").write_text(json.dumps({"key": removed}) + "\n")
    expected = {r["key"]: r["labels"] for b in ShardSet(tmp_path / "out").iter_batches() for r in b.to_pylist()}

    ds = read_shards(str(tmp_path / "out"), columns=["key", "labels"], verify=True)
    rows = ds.take_all()
    assert {r["key"]: list(r["labels"]) for r in rows} == expected
    assert removed not in expected and len(rows) == len(ss) - 1
    from pipelines.ray_source import _datasource_class

    tasks = _datasource_class()(str(tmp_path / "out")).get_read_tasks(parallelism=1)
    assert len(tasks) == len(ss.shards) > 1
