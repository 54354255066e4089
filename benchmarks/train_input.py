"""Training-input throughput: images/s delivered as model-ready batches, three ways, on the same images.

* ``folder_loop`` (baseline): what a script without shards does — open each JPEG/PNG file from
  the image folder, decode, augment, stack.
* ``shards``: ``training.data.ShardImageDataset`` over memory-mapped Arrow shards (the default
  ``--loader shards`` of ``jobs/pretrain.py``), through a torch DataLoader.
* ``ray_data``: ``pipelines.ray_source.read_shards`` + ``training.data.DecodeBatch`` as Ray Data
  tasks, consumed with ``iter_torch_batches`` (``--loader ray_data``). Ray Data once ran 2.7x
  slower than a DataLoader with transforms (ray issue #37499), so it is measured, not assumed.
  Its first pass pays Ray Data's start-up; the figure is the second (steady-state) pass.

All three use the same augmentation (Inception crop, flip, [-1, 1]) at the same resolution.

Input wait: each loader then feeds real training steps of a vitcore model (``--model``, bf16 on
CUDA) and the fraction of step time spent waiting for the next batch is reported, as
``jobs/pretrain.py`` logs it (``input_wait_fraction``). The shards loader runs with
``--loader-workers`` DataLoader processes, as pre-training does with ``--use-gpu``.
The final line is JSON.

    python benchmarks/train_input.py [--images 1200] [--img-size 224] [--batch 64] [--model Ti/16] [--device cuda]
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

import vitcore  # noqa: E402
from common.photos import photo  # noqa: E402
from demo.data import PHOTO_NAMES, random_crop  # noqa: E402
from pipelines.config import PrepareConfig  # noqa: E402
from pipelines.ingest import run_prepare  # noqa: E402
from pipelines.ray_source import read_shards  # noqa: E402
from pipelines.schema import ShardSet  # noqa: E402
from training.data import DecodeBatch, ShardImageDataset, normalize, train_transform  # noqa: E402
from training.loop import autocast  # noqa: E402
from training.ray_utils import init_ray  # noqa: E402


def make_folder(root: Path, n: int, size: int) -> Path:
    """``n`` real-photo crops in class folders (the demo's generator), saved at ``size`` px."""
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
    files = sorted(p for p in folder.rglob("*.jpg"))
    t = train_transform(img_size)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for i in range(0, len(files) - batch + 1, batch):
        x = np.stack([t(np.asarray(Image.open(f).convert("RGB")), rng) for f in files[i:i + batch]])
        torch.from_numpy(x)
    return (len(files) // batch * batch) / (time.perf_counter() - start)


def shards_loader(shards: str, img_size: int, batch: int) -> float:
    ds = ShardImageDataset(shards, train_transform(img_size))
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, drop_last=True)
    start, n = time.perf_counter(), 0
    for x, _ in loader:
        n += x.shape[0]
    return n / (time.perf_counter() - start)


def ray_data_loader(shards: str, img_size: int, batch: int, num_classes: int) -> float:
    decode = DecodeBatch(img_size, label_mode="single", num_classes=num_classes, holdout=0.0)
    ds = read_shards(shards, columns=["key", "image", "format", "height", "width", "labels"])
    ds = ds.map_batches(decode, batch_format="numpy", batch_size=batch)
    rate = 0.0
    # Pass 0 pays Ray Data's start-up (worker spawn, plan): a training run pays it once, so the
    # second pass is the steady state that an epoch sees.
    for _ in range(2):
        start, n = time.perf_counter(), 0
        for b in ds.iter_torch_batches(batch_size=batch, drop_last=True):
            n += normalize(b["image"]).shape[0]
        rate = n / (time.perf_counter() - start)
    return rate


def training_step(variant: str, img_size: int, num_classes: int, device: str):
    """One real optimiser step of a vitcore model per call (bf16 autocast on CUDA)."""
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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1200)
    ap.add_argument("--source-size", type=int, default=320, help="pixels of the generated photos")
    ap.add_argument("--shard-size", type=int, default=256, help="shorter side stored in the shards")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--model", default="Ti/16", help="vitcore variant trained for the input-wait figures")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--wait-steps", type=int, default=8, help="training steps per loader for the input-wait figures")
    ap.add_argument("--loader-workers", type=int, default=2, help="DataLoader processes of the shards loader for input wait")
    args = ap.parse_args(argv)

    import ray

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ.setdefault("VITSCALE_HOME", str(root / "mlruns"))
        folder = make_folder(root, args.images, args.source_size)
        shards = str(root / "shards")
        run_prepare(PrepareConfig(input=[str(folder)], output=shards, size=args.shard_size, workers=1))
        num_classes = len(ShardSet(shards).label_map)
        init_ray(log_to_driver=False)
        rates = {
            "folder_loop_img_s": folder_loop(folder, args.img_size, args.batch),
            "shards_img_s": shards_loader(shards, args.img_size, args.batch),
            "ray_data_img_s": ray_data_loader(shards, args.img_size, args.batch, num_classes),
        }
        step = training_step(args.model, args.img_size, num_classes, args.device)
        ds = ShardImageDataset(shards, train_transform(args.img_size, uint8=True))
        loader = torch.utils.data.DataLoader(ds, batch_size=args.batch, shuffle=True, drop_last=True,
                                             num_workers=args.loader_workers, pin_memory=args.device == "cuda")
        decode = DecodeBatch(args.img_size, label_mode="single", num_classes=num_classes, holdout=0.0)
        stream = read_shards(shards, columns=["key", "image", "format", "height", "width", "labels"]).map_batches(
            decode, batch_format="numpy", batch_size=args.batch)
        waits = {
            "shards_input_wait": input_wait(loader, step, args.wait_steps),
            "ray_data_input_wait": input_wait(((b["image"], b["label"]) for b in stream.iter_torch_batches(
                batch_size=args.batch, drop_last=True)), step, args.wait_steps),
        }
        cpus = int(ray.cluster_resources().get("CPU", 1))
        ray.shutdown()
    result = {
        "benchmark": "train_input",
        "images": args.images,
        "img_size": args.img_size,
        "batch": args.batch,
        "figure": "shards_img_s",
        "baseline": "folder_loop_img_s",
        **{k: round(v, 1) for k, v in rates.items()},
        "shards_vs_folder": round(rates["shards_img_s"] / rates["folder_loop_img_s"], 2),
        "ray_data_vs_shards": round(rates["ray_data_img_s"] / rates["shards_img_s"], 2),
        "model": args.model,
        "device": args.device,
        "loader_workers": args.loader_workers,
        **{k: round(v, 3) for k, v in waits.items()},
        "note": f"folder and shards loops use one core; Ray Data spreads decoding over {cpus} CPUs",
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
