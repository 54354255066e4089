"""Matching speed: corpus signatures against a test-set index, multi-index hashing vs brute force.

1M corpus images against an index of 100k test images on one core, build
included, in both directions: each corpus image brings
``signatures.CORPUS_CODES`` codes (the whole image, and its inner crops for test
images cut from it). Recorded, not a target: the search is paid at ingest, and
its target is a share of the ingest's item time, measured by
``benchmarks/dedup_ingest.py``. Signatures are random 128-bit codes
(real photos' codes cluster more, which fills some buckets more) with planted
near-duplicates at known distances, half forward (near a test image's code),
half reverse (an inner code near one of its crop variants); each test image
carries every crop variant, as built by ``TestSetIndex.add``. In the same run:
the forward-only search of the first code (the rule before the reverse direction), and a
brute-force baseline that evaluates the same rule over all pairs on a
subsample of queries, checked to return the same matches. The FINAL line is
one JSON object.

    PYTHONPATH=. OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/dedup.py [--queries 1000000 --index 100000]

Times are CPU seconds of the process (``*_wall_s``: wall seconds).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Run as a script, this file's folder comes first on sys.path and its name would
# shadow the ``dedup`` package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np

from neardup import signatures as sig
from neardup.index import DEFAULT_THRESHOLD, INNER_THRESHOLD_OFFSET, TestSetIndex


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=1_000_000)
    ap.add_argument("--index", type=int, default=100_000)
    ap.add_argument("--brute-queries", type=int, default=200)
    ap.add_argument("--planted", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    variants = len(sig.CROP_VARIANTS)
    index = TestSetIndex(threshold=DEFAULT_THRESHOLD)
    codes = rng.integers(0, 256, (args.index, variants, sig.SIGNATURE_BYTES), dtype=np.uint8)
    for i in range(args.index):
        index._append("bench", f"t{i}", "", f"h{i}", codes[i], 1)
    # CPU seconds of this process: per core by definition, and far less sensitive than wall
    # time to other work on a shared machine (wall seconds are reported beside them)
    t0, w0 = time.process_time(), time.perf_counter()
    index._ensure()
    build_s, build_wall = time.process_time() - t0, time.perf_counter() - w0

    k = sig.CORPUS_CODES
    queries = rng.integers(0, 256, (args.queries, k, sig.SIGNATURE_BYTES), dtype=np.uint8)
    # planted near-duplicates: a test image's code with bits flipped outside its first block,
    # up to the code's distance condition, so the rule accepts them; half go in the
    # brute-force subsample. Even rows plant the whole-image code near the identity code
    # (forward), odd rows an inner code near a random crop variant (reverse).
    planted_rows = np.concatenate([np.arange(args.planted // 2),
                                   rng.choice(np.arange(args.brute_queries, args.queries), args.planted - args.planted // 2,
                                              replace=False)])
    targets = rng.integers(0, args.index, len(planted_rows))
    code_slot = np.where(np.arange(len(planted_rows)) % 2, rng.integers(1, max(k, 2), len(planted_rows)), 0) \
        if k > 1 else np.zeros(len(planted_rows), dtype=np.int64)
    variant = np.where(code_slot == 0, 0, rng.integers(0, variants, len(planted_rows)))
    bits = np.unpackbits(codes[targets, variant], axis=1)
    for r in range(len(planted_rows)):
        flips = rng.integers(0, DEFAULT_THRESHOLD - (INNER_THRESHOLD_OFFSET if code_slot[r] else 0) + 1)
        flip = rng.choice(np.arange(32, sig.CODE_BITS), flips, replace=False)
        bits[r, flip] ^= 1
    queries[planted_rows, code_slot] = np.packbits(bits, axis=1)

    t0 = time.process_time()
    index.search(queries[:, 0])
    forward_s = time.process_time() - t0

    t0, w0 = time.process_time(), time.perf_counter()
    qi, rec, dist, _ = index.search_corpus(queries)
    search_s, search_wall = time.process_time() - t0, time.perf_counter() - w0
    found = set(zip(qi.tolist(), rec.tolist()))
    planted_found = sum((int(q), int(t)) in found for q, t in zip(planted_rows, targets))

    sub = queries[: args.brute_queries]
    t0 = time.process_time()
    bq, br, bd, _ = index.search_corpus(sub, brute=True)
    brute_s = time.process_time() - t0
    mask = qi < args.brute_queries
    agree = sorted(zip(qi[mask].tolist(), rec[mask].tolist(), dist[mask].tolist())) == \
        sorted(zip(bq.tolist(), br.tolist(), bd.tolist()))
    brute_per_query = brute_s / args.brute_queries
    result = {
        "benchmark": "dedup_match",
        "queries": args.queries, "codes_per_query": k, "index_images": args.index,
        "index_codes": args.index * variants,
        "threshold": DEFAULT_THRESHOLD, "code_bits": sig.CODE_BITS,
        "mih_build_s": round(build_s, 2), "mih_search_s": round(search_s, 2),
        "mih_total_s": round(build_s + search_s, 2), "mih_total_wall_s": round(build_wall + search_wall, 2),
        "forward_only_search_s": round(forward_s, 2),
        "mih_queries_per_s": round(args.queries / search_s),
        "brute_force_queries": args.brute_queries, "brute_force_s": round(brute_s, 2),
        "brute_force_extrapolated_s": round(brute_per_query * args.queries),
        "speedup": round(brute_per_query * args.queries / search_s, 1),
        "matches": int(len(qi)), "planted": len(planted_rows), "planted_found": planted_found,
        "agrees_with_brute_force": bool(agree),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
