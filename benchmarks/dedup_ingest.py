"""What de-duplication costs the ingest per image, on one core: with ``--test-set`` against without.

The per-item path of the ingest (:func:`pipelines.process.process_item`: decode, validate,
content hash, corpus signatures, resize, encode) on 2 MP JPEGs, then, with a test set, the
per-record lookup the Beam pipeline runs (``pipelines.graph.match_test_sets``) against an
index of ``--index`` test images (random codes under every crop variant, as
``benchmarks/dedup.py`` builds it, plus the photos' own test crops so some records match).
Also timed, in the same run: the signatures alone (``signatures.compute``, the whole-image
code the ingest stored before the reverse direction, against ``signatures.corpus_codes``, which adds the
inner crops), the one read of the image they share (``signatures.proxy``, the part that grows
with the image), ``corpus_codes`` of the image the ingest stores (resized to 384 px: an option,
not what the ingest does), and the item path with ``compute`` in place of ``corpus_codes`` and
with no signatures at all (its difference to the real item path is what the signatures cost
there, where the decoded image is fresh in the caches).
CPU time of this process, loops interleaved, best of ``--repeats``. Targets: the ingest with a
test set runs at >= 0.95 of its rate without one, and the signatures plus the lookup cost
<= 5% of the item time without a test set (``dedup_share_of_item``). The last line is one
JSON object.

    PYTHONPATH=. OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/dedup_ingest.py [--n 24 --index 100000]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

# Run as a script, this file's folder comes first on sys.path and benchmarks/dedup.py
# would shadow the ``dedup`` package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np
from PIL import Image

from neardup import signatures as sig
from neardup.index import TestSetIndex
from neardup.transforms import apply
from pipelines import process
from pipelines.graph import match_test_sets
from pipelines.process import ProcessOptions, process_item
from pipelines.sources import SourceItem

PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png", "camera.png")


def make_photos(n: int, megapixels: float, seed: int = 0) -> list[tuple[Image.Image, bytes]]:
    """Bundled photographs enlarged to ``megapixels`` with luminance grain, as JPEG q92."""
    import skimage

    data = os.path.join(os.path.dirname(skimage.__file__), "data")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        src = Image.open(os.path.join(data, PHOTOS[i % len(PHOTOS)])).convert("RGB")
        scale = (megapixels * 1e6 / (src.width * src.height)) ** 0.5
        big = src.resize((round(src.width * scale), round(src.height * scale)), Image.BICUBIC)
        arr = np.asarray(big, dtype=np.int16) + rng.normal(0, 6, (big.height, big.width, 1)).astype(np.int16)
        img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=92)
        out.append((src, buf.getvalue()))
    return out


def best(fn, items, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.process_time()
        for it in items:
            fn(it)
        times.append(time.process_time() - t)
    return min(times) / len(items)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=24, help="photos")
    ap.add_argument("--megapixels", type=float, default=2.0)
    ap.add_argument("--index", type=int, default=100_000, help="test images in the index")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    photos = make_photos(args.n, args.megapixels)
    items = [SourceItem(f"bench/{i}.jpg", (), data=d) for i, (_, d) in enumerate(photos)]
    opts = ProcessOptions()
    rng = np.random.default_rng(0)
    index = TestSetIndex()
    codes = rng.integers(0, 256, (args.index, len(sig.CROP_VARIANTS), sig.SIGNATURE_BYTES), dtype=np.uint8)
    for i in range(args.index):
        index._append("bench", f"t{i}", f"/test/t{i}.png", f"h{i}", codes[i], 1)
    for i, name in enumerate(PHOTOS):  # test images cut from the corpus photos: some records match
        index.add("bench", name, apply("reverse_crop_5_all_q50", photos[i][0]), source=f"/test/{name}")
    index._ensure()
    records = [process_item(it, opts) for it in items]
    matched = sum(match_test_sets(r, index)["_t"] == "duplicate" for r in records)

    decoded = [process.decode_image(d, uri="b", draft_short_side=opts.size) for _, d in photos]
    # what the signatures would cost on the image the ingest stores (resized to opts.size)
    stored = [process.resize(im, opts.size) for im in decoded]
    without = with_set = old_path = no_codes = compute_s = corpus_s = lookup_s = stored_s = proxy_s = float("inf")
    real = sig.corpus_codes
    for _ in range(args.repeats):  # interleaved, so a busy moment hits every loop alike
        without = min(without, best(lambda it: process_item(it, opts), items, 1))
        with_set = min(with_set, best(lambda it: match_test_sets(process_item(it, opts), index), items, 1))
        sig.corpus_codes = sig.compute
        try:
            old_path = min(old_path, best(lambda it: process_item(it, opts), items, 1))
            sig.corpus_codes = lambda img: b""
            no_codes = min(no_codes, best(lambda it: process_item(it, opts), items, 1))
        finally:
            sig.corpus_codes = real
        compute_s = min(compute_s, best(sig.compute, decoded, 1))
        corpus_s = min(corpus_s, best(sig.corpus_codes, decoded, 1))
        stored_s = min(stored_s, best(sig.corpus_codes, stored, 1))
        proxy_s = min(proxy_s, best(sig.proxy, decoded, 1))
        lookup_s = min(lookup_s, best(lambda r: match_test_sets(r, index), records, 1))
    result = {
        "benchmark": "dedup_ingest_cost", "photos": args.n, "megapixels": args.megapixels,
        "index_images": len(index), "records_matched": int(matched),
        "item_ms_without_test_set": round(without * 1e3, 3), "item_ms_with_test_set": round(with_set * 1e3, 3),
        "img_s_without_test_set": round(1 / without, 1), "img_s_with_test_set": round(1 / with_set, 1),
        "with_over_without": round(without / with_set, 4),
        "item_ms_whole_image_code_only": round(old_path * 1e3, 3),
        "item_ms_without_signatures": round(no_codes * 1e3, 3),
        "lookup_ms": round(lookup_s * 1e3, 3), "signature_ms_compute": round(compute_s * 1e3, 3), "signature_ms_corpus_codes": round(corpus_s * 1e3, 3),
        "signature_ms_corpus_codes_of_stored_image": round(stored_s * 1e3, 3),
        "signature_ms_proxy": round(proxy_s * 1e3, 3),
        "decoded_size": list(decoded[0].size), "stored_size": list(stored[0].size),
        "corpus_codes": sig.CORPUS_CODES,
        "dedup_share_of_item": round((corpus_s + lookup_s) / without, 4),
        "target": "img_s_with_test_set >= 0.95 * img_s_without_test_set; "
                  "signature_ms_corpus_codes + lookup_ms <= 0.05 * item_ms_without_test_set",
        "meets_target": with_set <= without / 0.95 and corpus_s + lookup_s <= 0.05 * without,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
