"""What checking shards against their manifest costs: sha256 GB/s beside a plain read of the same files.

    python benchmarks/shard_verify.py --gb 1 --shards 4

Writes ``--shards`` files of random bytes (``--gb`` in all) as a shard set's manifest lists
them, then times, on the same files from the page cache (the case of a stage that has just
opened them), a plain read in 4 MB blocks (the baseline) and ``ShardSet.verify_shards``, the
check every stage now makes once per process before reading a shard. CPU seconds
(process time) measure the work; wall seconds are reported beside them. The final JSON line
has both rates.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import machine  # noqa: E402
from pipelines import schema  # noqa: E402


def _timed(fn) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="total size of the shard files")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="best of this many timings of each")
    args = ap.parse_args(argv)
    size = int(args.gb * 1e9 / args.shards)
    with tempfile.TemporaryDirectory(prefix="shard_verify_") as root:
        entries = []
        block = os.urandom(1 << 22)
        for i in range(args.shards):
            name = schema.shard_name(i)
            h = hashlib.sha256()
            with open(os.path.join(root, name), "wb") as f:
                for start in range(0, size, len(block)):
                    chunk = block[: min(len(block), size - start)]
                    f.write(chunk)
                    h.update(chunk)
            entries.append({"path": name, "rows": 0, "bytes": size, "sha256": h.hexdigest()})
        with open(os.path.join(root, schema.MANIFEST), "w") as f:
            json.dump({"schema_version": schema.SCHEMA_VERSION, "shards": entries, "label_map": {}}, f)
        paths = [os.path.join(root, e["path"]) for e in entries]

        def plain_read():
            for p in paths:
                with open(p, "rb") as f:
                    while f.read(1 << 22):
                        pass

        def verify():
            schema._VERIFIED.clear()  # each timing hashes every shard, as a fresh process would
            schema.ShardSet(root, verify=True).verify_shards()

        plain_read()  # into the page cache
        read = min(_timed(plain_read) for _ in range(args.repeats))
        check = min(_timed(verify) for _ in range(args.repeats))
    total = size * args.shards
    result = {
        "benchmark": "shard_verify", "bytes": total, "shards": args.shards,
        "verify_gb_per_s": round(total / 1e9 / check[0], 2), "verify_wall_gb_per_s": round(total / 1e9 / check[1], 2),
        "plain_read_gb_per_s": round(total / 1e9 / read[0], 2),
        "plain_read_wall_gb_per_s": round(total / 1e9 / read[1], 2),
        "verify_s_per_100gb": round(100 / (total / 1e9 / check[0]), 1),
        "machine": machine.describe(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
