"""Ray Data datasource over a shard set: one read task per shard, streamed in record batches.

Ray is imported lazily so that :mod:`pipelines.schema` and the rest of the
ingest stay importable without it.
"""
from __future__ import annotations

from typing import Any, Sequence

from pipelines.schema import ShardSet


def _datasource_class():
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class ShardSetDatasource(Datasource):
        """Reads the shards of a :class:`~pipelines.schema.ShardSet`, honouring ``removed.jsonl``."""

        def __init__(self, directory: str, *, columns: Sequence[str] | None = None,
                     shard_indices: Sequence[int] | None = None, verify: bool | None = None):
            shard_set = ShardSet(directory, verify=verify)
            self._indices = list(range(len(shard_set.shards))) if shard_indices is None else list(shard_indices)
            if verify:
                shard_set.verify()
            elif shard_set.verifies:
                # Here, in the driver, once: the read tasks get the result and do not hash again.
                shard_set.verify_shards(self._indices)
            self._verify = shard_set.verifies
            self._verified = shard_set.verified_shards()
            self._directory = directory
            self._columns = list(columns) if columns is not None else None
            self._rows = {i: len(shard_set.retained_rows(i)) for i in self._indices}
            self._bytes = {i: int(shard_set.shards[i]["bytes"]) for i in self._indices}
            self._paths = {i: shard_set.shard_path(i) for i in self._indices}

        def estimate_inmemory_data_size(self) -> int | None:
            return sum(self._bytes.values())

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                           data_context: Any = None) -> list:
            # One task per shard whatever ``parallelism`` asks: a shard is the
            # unit of locality (one memory map) and of checksumming.
            # Every shard's result, not only the task's own: with a removed.jsonl, a ShardSet opens
            # all of its shards to count the rows that survive.
            directory, columns, verify, verified = self._directory, self._columns, self._verify, self._verified
            tasks = []
            for i in self._indices:
                def read(i=i):
                    import pyarrow as pa

                    # A shard rewritten since the driver checked it has another identity: hashed again.
                    shard_set = ShardSet(directory, verify=verify, verified=verified)
                    for batch in shard_set.iter_batches([i], columns=columns):
                        yield pa.Table.from_batches([batch])

                meta = BlockMetadata(num_rows=self._rows[i], size_bytes=self._bytes[i],
                                     input_files=[self._paths[i]], exec_stats=None)
                tasks.append(ReadTask(read, meta, per_task_row_limit=per_task_row_limit))
            return tasks

    return ShardSetDatasource


def read_shards(directory: str, *, columns: Sequence[str] | None = None,
                shard_indices: Sequence[int] | None = None, verify: bool | None = None, **kwargs: Any):
    """A streaming ``ray.data.Dataset`` of the rows of the shard set in ``directory``.

    Args:
        directory: the shard set written by ``prepare``.
        columns: read only these columns (default: all of :data:`pipelines.schema.COLUMNS`).
        shard_indices: read only these shards (e.g. a per-host split).
        verify: True: check every shard (sha256, size, rows) before reading; None (default):
            check each shard's sha256 once, here in the driver, unless VITSCALE_SKIP_SHARD_VERIFY=1;
            False: no check.
        **kwargs: passed to ``ray.data.read_datasource`` (``ray_remote_args``, ``concurrency``...).
    """
    import ray.data

    datasource = _datasource_class()(directory, columns=columns, shard_indices=shard_indices, verify=verify)
    return ray.data.read_datasource(datasource, **kwargs)
