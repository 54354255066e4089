"""The ingest: raw image corpus -> validated, de-duplicated Arrow IPC shards.

Data flows one way: :mod:`pipelines.sources` enumerates items (one reader per input
format), :mod:`pipelines.decode` and :mod:`pipelines.process` decode, validate, resize
and encode them, :mod:`pipelines.graph` is the Beam pipeline (exact and test-set
de-duplication, sharding; :mod:`pipelines.spill` keeps the images out of its shuffle,
:mod:`pipelines.shard_writer` writes each shard), and :mod:`pipelines.schema` owns the
shard format that training reads back, directly or through :mod:`pipelines.ray_source`.
:mod:`pipelines.ingest` drives a run: plan, run (:mod:`pipelines.runners`), check
(:mod:`pipelines.accounting`), publish (:mod:`pipelines.output`).

Nothing here imports Beam or Ray at package import time, so the dedup and
training code can use the decoder, the sources and the reader without them.
"""
