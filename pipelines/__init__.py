"""The ingest: raw image corpus -> validated, de-duplicated Arrow IPC shards.

Data flows one way: :mod:`pipelines.sources` enumerates items,
:mod:`pipelines.decode` decodes and validates them, :mod:`pipelines.ingest`
runs the Beam pipeline (resize, encode, exact and test-set de-duplication,
sharding; :mod:`pipelines.spill` keeps the images out of its shuffle) and
:mod:`pipelines.schema` owns the shard format that training reads
back, directly or through :mod:`pipelines.ray_source`.

Nothing here imports Beam or Ray at package import time, so the dedup and
training code can use the decoder, the sources and the reader without them.
"""
