"""Images per second per core of the ingest's decode -> resize -> encode path, against two baselines.

Both baselines run in the same process on the same in-memory JPEG bytes:

* naive: ``Image.open(f).convert('RGB').resize(target, BICUBIC)``, the loop most
  scripts write (full-resolution decode, no encode);
* decode-only at reduced scale: ``open -> draft(target) -> load -> RGB``, the
  practical ceiling of any Pillow-based path (the target is 0.8 of it). The
  project decodes colour JPEGs with libjpeg-turbo through ``simplejpeg`` into
  Pillow's memory, faster than Pillow's own draft decode (benchmarks/README.md),
  so its ratio to this ceiling can exceed what resizing and encoding would otherwise allow.

The project path is :func:`pipelines.decode.decode_image` with the DCT-draft
target, then :func:`pipelines.process.resize_encode`; the full per-item cost
(plus content hash and perceptual signature) is reported too.

A third reference explains where the speed-up stops: libjpeg-turbo decoding
at the 1/8 DCT scale, which does almost nothing but entropy (Huffman) decoding.
Every path that keeps full quality has to entropy-decode every coefficient,
whatever the scale; ``entropy_share_of_project`` is the part of the project's
time spent there. ``entropy_only_speedup_ceiling`` (naive over that floor) is the
speed-up a path would reach if everything but entropy decoding were free, and
``budget_beyond_entropy_for_3x_ms`` against ``project_beyond_entropy_ms`` says
whether 3x is within reach on the machine at hand. The ``machine`` object names
the processor's family and model, since the ratio moves between generations.
One process, timed in CPU seconds (``time.process_time``), so the figures are
per core. Loops are interleaved and repeated, and the best repeat counts,
because the machine may be shared.

Two corpora of large photos, both JPEG quality 92, both built from the real
photographs bundled with scikit-image and scikit-learn:

* ``grain``: each photograph enlarged to the full frame, with luminance grain
  added so that the bitrate is that of camera JPEGs (about 0.35 bytes a pixel)
  rather than of a smooth upsampled image. White grain is the hardest content
  for an entropy decoder, so this is the heavy case.
* ``mosaic``: the photographs at their native resolution, randomly flipped and
  tiled to fill the frame: real photographic detail and no synthetic noise
  (about 0.31 to 0.32 bytes a pixel).

Entropy decoding costs about the same per compressed byte in both; the
speed-up falls as the bitrate rises, because both the project and the naive
loop pay it in full. ``bytes_per_pixel`` is reported with every result.

    python benchmarks/ingest.py [--size 384] [--n 16] [--repeats 5] [--megapixels 2 4 8]
                                [--corpus grain mosaic]

With ``--readers``, the same mosaic photos are written as an image folder tree, WebDataset
shards and a Hugging Face Parquet file, and each source is read and processed whole through
:func:`pipelines.sources.iter_items` and :func:`~pipelines.process.process_item`; the figure is
each reader's images per second per core and its ratio to the folder reader's.

    python benchmarks/ingest.py --readers [--n 16] [--megapixels 2] [--repeats 3]

The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import machine  # noqa: E402  (this folder: the script's own path entry, after the repo root)
import numpy as np  # noqa: E402
import PIL.features  # noqa: E402
import simplejpeg  # noqa: E402
from PIL import Image  # noqa: E402

from common.photos import SKLEARN, photos  # noqa: E402
from pipelines.decode import decode_image  # noqa: E402
from pipelines.process import ProcessOptions, process_item, resize_encode, target_size  # noqa: E402
from pipelines.sources import SourceItem  # noqa: E402

PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "retina.jpg", "hubble_deep_field.jpg")


def _sources(names: tuple[str, ...] = PHOTOS) -> list[Image.Image]:
    """The named scikit-image photographs, then scikit-learn's two sample photographs."""
    return list(photos(names + SKLEARN).values())


def _frame(megapixels: float, aspect: float) -> tuple[int, int]:
    h = int(round((megapixels * 1e6 / aspect) ** 0.5))
    return int(round(h * aspect)), h


def _jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=92)
    return buf.getvalue()


def make_mosaics(n: int, megapixels: float, seed: int = 0) -> list[bytes]:
    """``n`` JPEGs of real photographs at native resolution, tiled row by row to fill the frame."""
    rng = np.random.default_rng(seed)
    # The retina photograph is mostly black background: as a 2 MP tile it would fill the frame with it.
    srcs = _sources(tuple(n for n in PHOTOS if n != "retina.jpg") + ("motorcycle_left.png", "ihc.png"))
    out = []
    for i in range(n):
        canvas = Image.new("RGB", _frame(megapixels, (4 / 3, 3 / 2, 1.0, 16 / 9)[i % 4]))
        y = 0
        while y < canvas.height:
            x, row = 0, canvas.height
            while x < canvas.width:
                tile = srcs[rng.integers(len(srcs))]
                if rng.random() < 0.5:
                    tile = tile.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
                canvas.paste(tile, (x, y))  # Pillow clips what falls outside the frame
                x, row = x + tile.width, min(row, tile.height)
            y += row
        out.append(_jpeg(canvas))
    return out


def make_photos(n: int, megapixels: float, seed: int = 0) -> list[bytes]:
    """``n`` JPEGs of real photographs enlarged to the frame, with luminance grain."""
    rng = np.random.default_rng(seed)
    srcs = _sources()
    out = []
    for i in range(n):
        src = srcs[i % len(srcs)]
        w, h = _frame(megapixels, src.width / src.height)
        big = np.asarray(src.resize((w, h), Image.Resampling.BICUBIC), np.float32)
        grain = rng.normal(0, 6, (h, w, 1)).astype(np.float32)  # luminance grain, like sensor noise
        out.append(_jpeg(Image.fromarray(np.clip(big + grain, 0, 255).astype(np.uint8))))
    return out


CORPORA = {"grain": make_photos, "mosaic": make_mosaics}


def naive(data: bytes, size: int) -> Image.Image:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    return img.resize(target_size(img.width, img.height, size, None, False), Image.Resampling.BICUBIC)


def decode_only(data: bytes, size: int) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.draft("RGB", target_size(img.width, img.height, size, None, False))
    img.load()
    return img.convert("RGB") if img.mode != "RGB" else img


def entropy_floor(data: bytes) -> None:
    simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=1, min_height=1)  # the smallest scale, 1/8


def project(data: bytes, opts: ProcessOptions) -> bytes:
    img = decode_image(data, uri="bench", draft_short_side=opts.size)
    return resize_encode(img, opts)[0]


def full_item(data: bytes, size: int, opts: ProcessOptions) -> dict:
    return process_item(SourceItem("bench", (), data=data), opts)


def time_loop(fn, datas: list[bytes]) -> float:
    # CPU time of this process: "per core" by definition, and far less
    # sensitive than wall time to other work on a shared machine.
    t = time.process_time()
    for d in datas:
        fn(d)
    return time.process_time() - t


def bench(datas: list[bytes], size: int, repeats: int) -> dict:
    opts = ProcessOptions(size=size, max_megapixels=1000)
    loops = {
        "project": lambda d: project(d, opts),
        "naive": lambda d: naive(d, size),
        "decode_only": lambda d: decode_only(d, size),
        "full_item": lambda d: full_item(d, size, opts),
        "entropy_floor": entropy_floor,
    }
    for fn in loops.values():  # warm-up: imports, allocator, page cache
        fn(datas[0])
    best = {k: float("inf") for k in loops}
    for _ in range(repeats):
        for name, fn in loops.items():
            best[name] = min(best[name], time_loop(fn, datas))
    rate = {k: len(datas) / v for k, v in best.items()}
    ms = {k: 1e3 * v / len(datas) for k, v in best.items()}
    pixels = np.array([np.prod(Image.open(io.BytesIO(d)).size) for d in datas], dtype=np.float64)
    nbytes = np.array([len(d) for d in datas], dtype=np.float64)
    return {
        "megapixels": round(float(pixels.mean()) / 1e6, 2),
        "mean_file_kb": round(float(nbytes.mean()) / 1e3, 1),
        "bytes_per_pixel": round(float(nbytes.sum() / pixels.sum()), 3),
        "project_img_s_per_core": round(rate["project"], 2),
        "naive_img_s_per_core": round(rate["naive"], 2),
        "decode_only_img_s_per_core": round(rate["decode_only"], 2),
        "full_item_img_s_per_core": round(rate["full_item"], 2),
        "speedup_vs_naive": round(rate["project"] / rate["naive"], 2),
        "ratio_to_decode_only": round(rate["project"] / rate["decode_only"], 3),
        "full_item_speedup_vs_naive": round(rate["full_item"] / rate["naive"], 2),
        "entropy_decode_img_s_per_core": round(rate["entropy_floor"], 2),
        "entropy_share_of_project": round(best["entropy_floor"] / best["project"], 3),
        # What no libjpeg-turbo path at full quality can beat on this machine: the
        # speed-up if resizing, encoding, the IDCT and colour conversion were free.
        "entropy_only_speedup_ceiling": round(best["naive"] / best["entropy_floor"], 2),
        # Time left per image, beyond entropy decoding, for a 3x speed-up; set
        # against what the project spends there now.
        "budget_beyond_entropy_for_3x_ms": round(ms["naive"] / 3 - ms["entropy_floor"], 3),
        "project_beyond_entropy_ms": round(ms["project"] - ms["entropy_floor"], 3),
        "ms_per_image": {k: round(v, 3) for k, v in ms.items()},
    }


# -- readers: the same photos in each on-disk format -------------------------------------------

def write_formats(datas: list[bytes], root: str) -> dict[str, str]:
    """``datas`` as a folder tree, WebDataset shards and a Hugging Face Parquet file under ``root``; their sources."""
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    for i, d in enumerate(datas):
        os.makedirs(f"{root}/folder/c{i % 4}", exist_ok=True)
        with open(f"{root}/folder/c{i % 4}/{i:06d}.jpg", "wb") as f:
            f.write(d)
    os.makedirs(f"{root}/wds", exist_ok=True)
    with tarfile.open(f"{root}/wds/shard-000000.tar", "w") as tf:
        for i, d in enumerate(datas):
            for ext, data in (("jpg", d), ("cls", str(i % 4).encode())):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    features = {"image": {"_type": "Image"}, "label": {"names": ["c0", "c1", "c2", "c3"], "_type": "ClassLabel"}}
    table = pa.table({"image": [{"bytes": d, "path": f"{i}.jpg"} for i, d in enumerate(datas)],
                      "label": [i % 4 for i in range(len(datas))]})
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    pq.write_table(table, f"{root}/train-00000-of-00001.parquet", row_group_size=100)
    return {"folder": f"{root}/folder", "webdataset": f"{root}/wds",
            "hf_parquet": f"{root}/train-00000-of-00001.parquet"}


def bench_readers(datas: list[bytes], size: int, repeats: int) -> dict:
    """Images per second per core of reading and processing each format's copy of ``datas``, best of ``repeats``."""
    import tempfile

    from pipelines.sources import iter_items

    opts = ProcessOptions(size=size, max_megapixels=1000)
    with tempfile.TemporaryDirectory() as root:
        sources = write_formats(datas, root)
        best = {name: float("inf") for name in sources}
        for src in sources.values():  # warm-up: imports, decoders, page cache
            process_item(next(iter_items(src)), opts)
        for _ in range(repeats):  # interleaved: a shared machine slows all of them alike
            for name, src in sources.items():
                t = time.process_time()
                rows = [process_item(item, opts) for item in iter_items(src)]
                best[name] = min(best[name], time.process_time() - t)
                assert len(rows) == len(datas) and all(r["_t"] == "record" for r in rows), name
    rate = {name: len(datas) / v for name, v in best.items()}
    return {**{f"{name}_img_s_per_core": round(r, 2) for name, r in rate.items()},
            **{f"{name}_ratio_to_folder": round(r / rate["folder"], 3) for name, r in rate.items() if name != "folder"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=384)
    ap.add_argument("--n", type=int, default=16, help="photos per resolution")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--megapixels", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    ap.add_argument("--corpus", nargs="+", choices=sorted(CORPORA), default=["grain", "mosaic"])
    ap.add_argument("--readers", action="store_true",
                    help="time the folder, WebDataset and Hugging Face Parquet readers on the same mosaic photos")
    args = ap.parse_args()
    if args.readers:
        results = {f"{mp:g}MP": bench_readers(make_mosaics(args.n, mp), args.size, args.repeats)
                   for mp in args.megapixels}
        print(json.dumps({"benchmark": "ingest_readers", "size": args.size, "n": args.n,
                          "figure": "img_s_per_core", "baseline": "folder_img_s_per_core", "results": results,
                          "machine": machine.describe()}))
        return

    results: dict[str, dict] = {}
    for corpus in args.corpus:
        for mp in args.megapixels:
            datas = CORPORA[corpus](args.n, mp)
            results.setdefault(corpus, {})[f"{mp:g}MP"] = r = bench(datas, args.size, args.repeats)
            print(f"{corpus} {mp:g} MP: {json.dumps(r)}", flush=True)
    flat = {f"{corpus}_{k}": r for corpus, rs in results.items() for k, r in rs.items()}
    print(json.dumps({
        "benchmark": "ingest_decode_resize_encode",
        "size": args.size,
        "figure": "project_img_s_per_core",
        "baseline": "naive_img_s_per_core",
        **{f"speedup_vs_naive_{k}": r["speedup_vs_naive"] for k, r in flat.items()},
        **{f"ratio_to_decode_only_{k}": r["ratio_to_decode_only"] for k, r in flat.items()},
        "results": results,
        "machine": {
            **machine.describe(), "pillow": Image.__version__,
            "libjpeg_turbo": PIL.features.check("libjpeg_turbo"),
        },
    }))


if __name__ == "__main__":
    main()
