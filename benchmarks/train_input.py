"""Training-input throughput on the CPU: the crop split (decode on the CPU, augment on the device)
against today's per-item loader and against JPEG decode alone, on the same shards in the same run.

Per core (the final JSON line; run pinned to one core, ``taskset -c 1``), CPU time of this process:

* ``loader_img_s_per_core``: ``training.data.ShardCropDataset`` through a DataLoader, in process:
  row read, box and flip draw, decode at the DCT scale the box allows, copy into a uint8 canvas.
* ``decode_only_img_s_per_core``: libjpeg-turbo (simplejpeg) decoding every row at full scale, the
  rows' bytes already in hand.
* ``legacy_img_s_per_core``: ``training.data.ShardImageDataset`` with ``train_transform(size,
  uint8=True)`` (decode, PIL crop and resize, flip, uint8 CHW) and ``default_collate``.
* ``ray_decode_batch_*``: ``training.data.DecodeBatch``, the Ray Data task's body, both ways.
* ``device_side_img_s_per_core``: ``training.augment.crop_resize_flip`` run on this CPU, for scale only:
  on a GPU it runs after the host-to-device copy.

``--profile`` adds a per-stage breakdown (microseconds per image), including the hand-off from a
DataLoader process (the CPU of one worker process plus the trainer's, minus the same rows in
process). ``--handoff`` measures that hand-off alone, repeated: fresh shared memory for every batch (the
baseline) against each DataLoader process's ring of reused canvases (``training.data.CANVAS_RING``).
``--raw`` also stores the shards with ``prepare --store raw`` and measures both loaders
on them. ``--loaders`` runs the end-to-end comparison (wall clock): a folder-of-JPEGs loop, the shards
loader and Ray Data, each per item (float) and as the crop split (``*_crop_*``), then their input
wait while training ``--model``, the crop split's device half inside the step.

Without ``--shards``, shards of ``--images`` real-photo crops (the demo's generator) are made at
``--size`` px. The final line is JSON.

    python benchmarks/train_input.py [--shards DIR | --size 256 --images 1500] [--img-size 224] [--profile] [--handoff] [--raw] [--loaders]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402


def make_folder(root: Path, n: int, size: int) -> Path:
    """``n`` real-photo crops in class folders (the demo's generator), saved at ``size`` px."""
    from common.photos import photo
    from demo.data import PHOTO_NAMES, random_crop

    rng = np.random.default_rng(0)
    folder = root / "images"
    per = max(1, n // len(PHOTO_NAMES))
    for name in PHOTO_NAMES:
        cls = folder / Path(name).stem
        cls.mkdir(parents=True)
        base = photo(name)
        for i in range(per):
            random_crop(base, size, rng).save(cls / f"{i:05d}.jpg", "JPEG", quality=90)
    return folder


def folder_loop(folder: Path, img_size: int, batch: int) -> float:
    from training.data import train_transform

    files = sorted(p for p in folder.rglob("*.jpg"))
    t = train_transform(img_size)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for i in range(0, len(files) - batch + 1, batch):
        x = np.stack([t(np.asarray(Image.open(f).convert("RGB")), rng) for f in files[i:i + batch]])
        torch.from_numpy(x)
    return (len(files) // batch * batch) / (time.perf_counter() - start)


def shards_loader(shards: str, img_size: int, batch: int, crop: bool = False) -> float:
    """Images/s delivered by the shards loader in process: float per item, or crop batches."""
    from training.data import (
        ShardCropDataset,
        ShardImageDataset,
        collate_crops,
        train_transform,
    )

    if crop:
        loader = torch.utils.data.DataLoader(ShardCropDataset(shards, img_size), batch_size=batch, shuffle=True,
                                             drop_last=True, collate_fn=collate_crops)
    else:
        loader = torch.utils.data.DataLoader(ShardImageDataset(shards, train_transform(img_size)), batch_size=batch,
                                             shuffle=True, drop_last=True)
    start, n = time.perf_counter(), 0
    for b in loader:
        n += len(b["label"] if crop else b[1])
    return n / (time.perf_counter() - start)


def ray_stream(shards: str, img_size: int, batch: int, num_classes: int, crop: bool = False):
    from pipelines.ray_source import read_shards
    from pipelines.schema import ShardSet
    from training.data import DecodeBatch, canvas_shape

    canvas = canvas_shape(ShardSet(shards), img_size) if crop else None
    decode = DecodeBatch(img_size, label_mode="single", num_classes=num_classes, holdout=0.0, canvas=canvas)
    ds = read_shards(shards, columns=["key", "image", "format", "height", "width", "labels"])
    return ds.map_batches(decode, batch_format="numpy", batch_size=batch)


def ray_data_loader(shards: str, img_size: int, batch: int, num_classes: int, crop: bool = False) -> float:
    ds = ray_stream(shards, img_size, batch, num_classes, crop)
    rate = 0.0
    # Pass 0 pays Ray Data's start-up (worker spawn, plan): a training run pays it once, so the
    # second pass is the steady state that an epoch sees.
    for _ in range(2):
        start, n = time.perf_counter(), 0
        for b in ds.iter_torch_batches(batch_size=batch, drop_last=True):
            n += b["label"].shape[0]
        rate = n / (time.perf_counter() - start)
    return rate


def training_step(variant: str, img_size: int, num_classes: int, device: str):
    """One real optimiser step of a vitcore model per call (bf16 autocast on CUDA)."""
    import vitcore
    from training.data import normalize
    from training.loop import autocast

    model = vitcore.create_model(variant, num_classes=num_classes, img_size=img_size).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dev = torch.device(device)

    def step(x, y):
        x, y = normalize(x.to(dev, non_blocking=True)), y.to(dev, non_blocking=True)
        with autocast(dev, True):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def input_wait(batches, step, steps: int) -> float:
    """Fraction of wall time spent waiting for the next batch over ``steps`` training steps
    (after one warm-up step); the device is synchronised before the clock stops."""
    it = iter(batches)
    step(*next(it))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    waited, start = 0.0, time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - t
        step(x, y)
    sync()
    return waited / (time.perf_counter() - start)


def _rate(n: int, fn) -> float:
    start = time.process_time()
    fn()
    return n / (time.process_time() - start)


def _drain(loader) -> None:
    for _ in loader:
        pass


def per_core(shards: str, img_size: int, batch: int, repeats: int) -> dict:
    """Images/s per core of the three CPU paths over the same rows, in the same order; each the
    median of ``repeats`` interleaved rounds after one warm-up round (page cache, column views)."""
    import simplejpeg

    from pipelines.schema import ShardSet
    from training.augment import crop_resize_flip
    from training.data import (
        DecodeBatch,
        ShardCropDataset,
        ShardImageDataset,
        collate_crops,
        train_transform,
    )

    ss = ShardSet(shards)
    order = np.random.default_rng(0).permutation(len(ss))[: len(ss) // batch * batch].tolist()
    crop = ShardCropDataset(ss, img_size)
    legacy = ShardImageDataset(ss, train_transform(img_size, uint8=True))
    loaders = {
        "loader": torch.utils.data.DataLoader(crop, batch_size=batch, sampler=order, collate_fn=collate_crops),
        "legacy": torch.utils.data.DataLoader(legacy, batch_size=batch, sampler=order),
    }
    rows = [crop._row(i) for i in order]

    def decode_only():
        for data, fmt, h, w, _ in rows:
            simplejpeg.decode_jpeg(data) if fmt == "jpeg" else np.frombuffer(data, np.uint8).reshape(h, w, 3).copy()

    # Ray Data hands DecodeBatch `batch` rows at a time (map_batches(batch_size=64) in pre-training).
    records = [{k: v[i:i + batch] for k, v in r.items()} for r in (
        b.to_pydict() for b in ss.iter_batches(columns=["key", "image", "format", "height", "width", "labels"]))
        for i in range(0, len(r["key"]), batch)]
    ray_new = DecodeBatch(img_size, label_mode="single", num_classes=len(ss.label_map), holdout=0.0,
                          canvas=crop.canvas)
    ray_old = DecodeBatch(img_size, label_mode="single", num_classes=len(ss.label_map), holdout=0.0)
    sample = next(iter(loaders["loader"]))
    fns = {
        "loader": lambda: _drain(loaders["loader"]),
        "decode_only": decode_only,
        "legacy": lambda: _drain(loaders["legacy"]),
        "ray_decode_batch": lambda: [ray_new(r) for r in records],
        "ray_decode_batch_legacy": lambda: [ray_old(r) for r in records],
    }
    counts = {k: len(order) for k in fns} | {"ray_decode_batch": len(ss), "ray_decode_batch_legacy": len(ss)}
    rounds = {k: [] for k in fns}
    for r in range(repeats + 1):
        for k, fn in fns.items():
            rate = _rate(counts[k], fn)
            if r:
                rounds[k].append(rate)
    out = {f"{k}_img_s_per_core": round(float(np.median(v)), 1) for k, v in rounds.items()}
    out["device_side_img_s_per_core"] = round(_rate(batch, lambda: crop_resize_flip(
        sample["image"], sample["box"], sample["extent"], sample["flip"], img_size)), 1)
    out["canvas"] = list(crop.canvas)
    out["bytes_per_image"] = round(sum(int(e["bytes"]) for e in ss.shards) / len(ss))
    return out


class _Stages:
    """CPU microseconds per stage, summed over items (this thread's clock)."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self.t = time.thread_time_ns()

    def lap(self, name: str) -> None:
        now = time.thread_time_ns()
        self.total[name] = self.total.get(name, 0.0) + (now - self.t) / 1e3
        self.t = now


def handoff_us(dataset, order: list[int], batch: int, collate=None, release: bool = False,
               trainer_share: bool = False) -> float | tuple[float, float]:
    """CPU microseconds per image that one DataLoader process adds: worker plus trainer process,
    minus the same rows in process (resource usage of this process and its reaped children).
    ``release``: the trainer hands each crop batch's canvas back (``training.data.release_canvases``).
    ``trainer_share``: also the trainer process's own microseconds per image (receiving the batches)."""
    import resource

    from training.data import release_canvases

    def cpu(workers: int) -> list[float]:
        kw = {"collate_fn": collate} if collate else {}
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=order, num_workers=workers, **kw)
        before = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        _drain(release_canvases(loader) if release else loader)
        del loader
        after = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return [a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before)]

    cpu(0)
    in_process, worker = sum(cpu(0)), cpu(1)
    total = (sum(worker) - in_process) / len(order) * 1e6
    return (total, worker[0] / len(order) * 1e6) if trainer_share else total


def handoff(shards: str, img_size: int, batch: int, repeats: int, passes: int) -> dict:
    """The crop split's hand-off from one DataLoader process, CPU microseconds per image: fresh shared
    memory per batch (``ring=0``, the baseline) against the canvas ring with ``release_canvases``;
    medians of ``repeats`` interleaved rounds, each its own pair of loaders over ``passes`` passes of
    the rows (a process's start and its ring's first touch are paid once per epoch, not per batch)."""
    from pipelines.schema import ShardSet
    from training.data import CANVAS_RING, ShardCropDataset, collate_crops

    ss = ShardSet(shards)
    order = np.random.default_rng(0).permutation(len(ss))[: len(ss) // batch * batch].tolist() * passes
    canvas = ShardCropDataset(ss, img_size).canvas
    rounds = {"fresh_shared_memory": [], "canvas_ring": []}
    trainer = {"fresh_shared_memory": [], "canvas_ring": []}
    for _ in range(repeats):
        for k, ring, release in (("fresh_shared_memory", 0, False), ("canvas_ring", CANVAS_RING, True)):
            total, own = handoff_us(ShardCropDataset(ss, img_size, canvas=canvas, ring=ring), order, batch,
                                    collate_crops, release=release, trainer_share=True)
            rounds[k].append(total)
            trainer[k].append(own)
    out = {f"handoff_us_{k}": round(float(np.median(v)), 1) for k, v in rounds.items()}
    # Of which the trainer process (receiving each batch); the rest is the DataLoader process's.
    out |= {f"handoff_trainer_us_{k}": round(float(np.median(v)), 1) for k, v in trainer.items()}
    out["handoff_images"] = len(order)
    out["handoff_us_rounds"] = {k: [round(x, 1) for x in v] for k, v in rounds.items()}
    return out


def profile(shards: str, img_size: int, batch: int) -> dict:
    """Per-stage CPU microseconds per image of the per-item loader and of the crop split's CPU half,
    each stage as the loaders run it, over the same rows."""
    import simplejpeg
    from PIL import Image
    from torch.utils.data import default_collate

    from pipelines.schema import ShardSet, decode_row_image
    from training import data as D
    from training.augment import crop_resize_flip

    ss = ShardSet(shards)
    order = np.random.default_rng(0).permutation(len(ss))[: len(ss) // batch * batch].tolist()
    crop = D.ShardCropDataset(ss, img_size)
    legacy_ds = D.ShardImageDataset(ss, D.train_transform(img_size, uint8=True))
    for i in order[:batch]:  # warm-up: page cache, column views
        crop._row(i), ss[i]

    old = _Stages()
    items = []
    for k, index in enumerate(order):
        record = ss[index]
        old.lap("row read")
        arr = decode_row_image(record)
        old.lap("decode")
        rng = np.random.default_rng((0, 0, index))
        old.lap("generator")
        img = Image.fromarray(arr)
        old.lap("PIL round trip")
        img = D.inception_crop(img, img_size, rng)
        old.lap("crop + resize")
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        old.lap("flip")
        x = torch.from_numpy(D.to_uint8_chw(np.asarray(img)))
        y = D.encode_target(record["labels"], "single", crop.num_classes, row=record["source"])
        old.lap("PIL round trip")
        items.append((x, y))
        if len(items) == batch:
            default_collate(items)
            items = []
            old.lap("collation")

    new = _Stages()
    canvas = torch.empty((batch, *crop.canvas, 3), dtype=torch.uint8).numpy()
    for k, index in enumerate(order):
        data, fmt, h, w, ids = crop._row(index)
        new.lap("row read")
        rng = np.random.default_rng((0, 0, index))
        new.lap("generator")
        box = D.inception_box(w, h, rng)
        flip = rng.random() < 0.5
        new.lap("box + flip draw")
        d = D.dct_denom(min(box[2] - box[0], box[3] - box[1]), img_size)
        arr, d = D._decode_at_scale(data, fmt, h, w, d)
        new.lap("decode")
        slot = canvas[k % batch]
        x0, y0, x1, y1 = (v / d for v in box)
        mx, my = D._tap_margin(x1 - x0, img_size), D._tap_margin(y1 - y0, img_size)
        rx0, ry0 = max(0, int(x0) - mx), max(0, int(y0) - my)
        rx1, ry1 = min(arr.shape[1], int(np.ceil(x1)) + mx), min(arr.shape[0], int(np.ceil(y1)) + my)
        slot[:ry1 - ry0, :rx1 - rx0] = arr[ry0:ry1, rx0:rx1]
        new.lap("crop copy into canvas")
        int(ids[0]), flip
        if k % batch == batch - 1:
            torch.from_numpy(canvas), torch.tensor([0] * batch)
            new.lap("collation")

    n = len(order)
    table = {"legacy_us": {k: round(v / n, 1) for k, v in old.total.items()},
             "crop_split_us": {k: round(v / n, 1) for k, v in new.total.items()}}
    table["legacy_us"]["hand-off (1 DataLoader process)"] = round(handoff_us(legacy_ds, order, batch), 1)
    fresh = D.ShardCropDataset(ss, img_size, ring=0)  # the baseline: new shared memory for every batch
    table["crop_split_us"]["hand-off (1 DataLoader process), fresh shared memory"] = round(
        handoff_us(fresh, order, batch, D.collate_crops), 1)
    table["crop_split_us"]["hand-off (1 DataLoader process), canvas ring"] = round(
        handoff_us(crop, order, batch, D.collate_crops, release=True), 1)
    sample = crop.__getitems__(order[:batch])
    start = time.thread_time_ns()
    crop_resize_flip(sample["image"], sample["box"], sample["extent"], sample["flip"], img_size)
    table["device_side_on_this_cpu_us"] = round((time.thread_time_ns() - start) / 1e3 / batch, 1)
    # Every DCT scale on one of the shards' images: why only halvings are taken (DCT_DENOMS).
    data, _, h, w, _ = crop._row(order[0])
    scales = {}
    for m in range(1, 9):
        start = time.thread_time_ns()
        for _ in range(50):
            simplejpeg.decode_jpeg(data, min_height=-(-h * m // 8), min_width=-(-w * m // 8))
        scales[f"{m}/8"] = round((time.thread_time_ns() - start) / 1e3 / 50, 1)
    table["decode_us_by_dct_scale"] = scales
    table["batch_canvas_fill_ms"] = fill_ms(batch * crop.canvas[0] * crop.canvas[1] * 3)
    return table


def fill_ms(nbytes: int, reps: int = 20) -> dict:
    """Milliseconds to write a batch's bytes into fresh shared memory (a DataLoader process's
    batch) and into private memory that the allocator reuses (a batch made in process)."""
    out = {}
    for kind in ("shared", "private"):
        start = time.thread_time_ns()
        for _ in range(reps):
            if kind == "shared":
                t = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))
            else:
                t = torch.empty(nbytes, dtype=torch.uint8)
            t.fill_(1)
            del t
        out[kind] = round((time.thread_time_ns() - start) / 1e6 / reps, 2)
    return out


def make_shards(root: Path, images: int, source_size: int, size: int, store: str = "jpeg",
                source: str | None = None) -> tuple[str, Path | None]:
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    folder = None
    if source is None:
        folder = make_folder(root, images, source_size)
        source = str(folder)
    out = str(root / f"shards-{store}")
    run_prepare(PrepareConfig(input=[source], output=out, size=size, store=store, workers=1))
    return out, folder


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", help="an existing shard set; default: make one from the bundled photos")
    ap.add_argument("--images", type=int, default=1500)
    ap.add_argument("--source-size", type=int, default=320, help="pixels of the generated photos")
    ap.add_argument("--size", "--shard-size", dest="size", type=int, default=256,
                    help="shorter side stored in the generated shards")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per per-core figure (median)")
    ap.add_argument("--profile", action="store_true", help="also print the per-stage table")
    ap.add_argument("--handoff", action="store_true",
                    help="also measure the DataLoader hand-off, fresh shared memory against the canvas ring")
    ap.add_argument("--handoff-passes", type=int, default=4, help="passes over the rows per --handoff round")
    ap.add_argument("--raw", action="store_true", help="also store the shards raw (prepare --store raw) and measure")
    ap.add_argument("--loaders", action="store_true", help="also run the end-to-end loader and input-wait comparison")
    ap.add_argument("--model", default="Ti/16", help="vitcore variant trained for the input-wait figures")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--wait-steps", type=int, default=8, help="training steps per loader for the input-wait figures")
    ap.add_argument("--loader-workers", type=int, default=2, help="DataLoader processes of the shards loader for input wait")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    result = {"benchmark": "train_input", "img_size": args.img_size, "batch": args.batch,
              "figure": "loader_img_s_per_core", "baseline": "legacy_img_s_per_core"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ.setdefault("VITSCALE_HOME", str(root / "mlruns"))
        folder = None
        shards = args.shards
        if shards is None:
            shards, folder = make_shards(root, args.images, args.source_size, args.size)
        from pipelines.schema import ShardSet

        result.update(shards=args.shards or f"generated: {len(ShardSet(shards))} photo crops at {args.size} px",
                      **per_core(shards, args.img_size, args.batch, args.repeats))
        result["loader_vs_decode_only"] = round(result["loader_img_s_per_core"] / result["decode_only_img_s_per_core"], 3)
        result["loader_vs_legacy"] = round(result["loader_img_s_per_core"] / result["legacy_img_s_per_core"], 2)
        if args.profile:
            result["profile"] = profile(shards, args.img_size, args.batch)
        if args.handoff:
            result.update(handoff(shards, args.img_size, args.batch, max(args.repeats, 5), args.handoff_passes))
        if args.raw:
            raw, _ = make_shards(root, 0, 0, args.size, store="raw", source=shards)
            figures = per_core(raw, args.img_size, args.batch, args.repeats)
            result["raw"] = {k: figures[k] for k in ("loader_img_s_per_core", "legacy_img_s_per_core", "bytes_per_image")}
        if args.loaders:
            result.update(end_to_end(shards, folder, args))
    print(json.dumps(result), flush=True)
    if args.loaders:
        # After the line: an iterator of a finished stream collected after shutdown ends the process.
        import ray

        ray.shutdown()
    return result


def end_to_end(shards: str, folder: Path | None, args) -> dict:
    """The loaders as pre-training runs them (wall clock), then their input wait under real steps."""
    import ray

    from pipelines.schema import ShardSet
    from training.augment import device_batch
    from training.data import (
        ShardCropDataset,
        ShardImageDataset,
        collate_crops,
        train_transform,
    )
    from training.ray_utils import init_ray

    num_classes = len(ShardSet(shards).label_map)
    init_ray(log_to_driver=False)
    rates = {
        "shards_img_s": shards_loader(shards, args.img_size, args.batch),
        "shards_crop_img_s": shards_loader(shards, args.img_size, args.batch, crop=True),
        "ray_data_img_s": ray_data_loader(shards, args.img_size, args.batch, num_classes),
        "ray_data_crop_img_s": ray_data_loader(shards, args.img_size, args.batch, num_classes, crop=True),
    }
    if folder is not None:
        rates["folder_loop_img_s"] = folder_loop(folder, args.img_size, args.batch)
    step = training_step(args.model, args.img_size, num_classes, args.device)

    def crop_step(b, _):
        # The device half runs in the step, after the host-to-device copy, as the trainer will run it.
        step(*device_batch(b, args.img_size, args.device))

    def loader(crop: bool):
        ds = ShardCropDataset(shards, args.img_size) if crop else ShardImageDataset(
            shards, train_transform(args.img_size, uint8=True))
        dl = torch.utils.data.DataLoader(ds, batch_size=args.batch, shuffle=True, drop_last=True,
                                         num_workers=args.loader_workers, pin_memory=args.device == "cuda",
                                         **({"collate_fn": collate_crops} if crop else {}))
        return ((b, None) for b in dl) if crop else dl

    def stream(crop: bool):
        batches = ray_stream(shards, args.img_size, args.batch, num_classes, crop).iter_torch_batches(
            batch_size=args.batch, drop_last=True)
        return ((b, None) if crop else (b["image"], b["label"]) for b in batches)

    waits = {
        "shards_input_wait": input_wait(loader(False), step, args.wait_steps),
        "shards_crop_input_wait": input_wait(loader(True), crop_step, args.wait_steps),
        "ray_data_input_wait": input_wait(stream(False), step, args.wait_steps),
        "ray_data_crop_input_wait": input_wait(stream(True), crop_step, args.wait_steps),
    }
    cpus = int(ray.cluster_resources().get("CPU", 1))
    return {
        **{k: round(v, 1) for k, v in rates.items()},
        "model": args.model, "device": args.device, "loader_workers": args.loader_workers,
        **{k: round(v, 3) for k, v in waits.items()},
        "note": f"folder and shards loops use one core; Ray Data spreads decoding over {cpus} CPUs",
    }


if __name__ == "__main__":
    main()
