"""De-duplication jobs that read corpora and shard sets through :mod:`pipelines`.

:mod:`dedup.job` and :mod:`dedup.rescan` re-check shard sets against test sets incrementally
(``removed.jsonl``, ``dedup_state.json``); :mod:`dedup.calibration` measures the match rule on
held-out photographs and chooses its threshold. The signatures, the match rule and the index
they use are in :mod:`neardup`.
"""
