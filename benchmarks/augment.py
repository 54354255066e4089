"""RandAugment and Mixup, batched on the device path against Pillow per item, on the same images.

Per image on one core (``torch.set_num_threads(1)``; run it pinned, ``taskset -c 1``), wall time,
best of ``--rounds`` interleaved rounds:

* ``device_us_per_image``: ``training.randaugment.RandAugment(2, 15)`` on a float batch of whole
  pixel values (B, 3, 224, 224) as the device path's crop leaves it, the value range, then
  ``training.mixup.Mixer`` (Mixup 0.2) on the batch, all with CPU tensors;
* ``item_us_per_image``: the per-item path's work for the same images: ``RandAugment.pil`` on each
  224 px Pillow image, the value range (``training.data.value_range``), the stack, the same Mixup.

With a CUDA device, ``device_fraction_of_b16_step`` is the device path's time on that GPU (bf16
model, the batch in fp32 as the trainer makes it) over one ViT-B/16 training step at 224 px on the
same batch (AdamW, bf16 autocast, eager); without one it is null.

The final line is JSON.

    PYTHONPATH=. taskset -c 1 python benchmarks/augment.py [--images 64] [--rounds 3] [--gpu-batch 128]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from training.data import value_range  # noqa: E402
from training.mixup import Mixer  # noqa: E402
from training.randaugment import RandAugment  # noqa: E402

SIZE = 224


def photo_crops(n: int) -> list:
    """``n`` 224 px crops of the bundled photographs (the demo's generator)."""
    from common.photos import photo
    from demo.data import PHOTO_NAMES, random_crop

    rng = np.random.default_rng(0)
    bases = [photo(name).convert("RGB") for name in PHOTO_NAMES]
    return [random_crop(bases[i % len(bases)], SIZE, rng) for i in range(n)]


def device_path(x: torch.Tensor, y: torch.Tensor, ra: RandAugment, mixer: Mixer, key: tuple[int, ...]) -> torch.Tensor:
    out = ra(x, key).sub_(127.5).div_(127.5)
    return mixer(out, y, 10, key=key)[0]


def item_path(images: list, y: torch.Tensor, ra: RandAugment, mixer: Mixer, key: tuple[int, ...]) -> torch.Tensor:
    rngs = [np.random.default_rng((0, *key, i)) for i in range(len(images))]
    x = torch.from_numpy(np.stack([value_range(np.asarray(ra.pil(img, r))) for img, r in zip(images, rngs)]))
    return mixer(x, y, 10, key=key)[0]


def cpu_figures(n: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    images = photo_crops(n)
    x = torch.from_numpy(np.stack([np.asarray(i) for i in images])).permute(0, 3, 1, 2).float().contiguous()
    y = torch.arange(n) % 10
    ra, mixer = RandAugment(2, 15), Mixer(mixup=0.2)
    device, item = [], []
    for r in range(rounds):
        t = time.perf_counter()
        device_path(x, y, ra, mixer, (r, 0, 0))
        device.append(time.perf_counter() - t)
        t = time.perf_counter()
        item_path(images, y, ra, mixer, (r, 0, 0))
        item.append(time.perf_counter() - t)
    d, i = min(device) / n * 1e6, min(item) / n * 1e6
    return {"device_us_per_image": round(d, 1), "item_us_per_image": round(i, 1),
            "item_over_device": round(i / d, 2)}


def gpu_fraction(batch: int, steps: int) -> dict:
    """The device path's time over one B/16 step at 224 on the same batch, on this GPU."""
    import vitcore

    dev = torch.device("cuda")
    model = vitcore.create_model("B/16", num_classes=1000, img_size=SIZE).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (batch, 3, SIZE, SIZE), generator=g).float().to(dev)
    y = torch.randint(0, 1000, (batch,), generator=g).to(dev)
    ra, mixer = RandAugment(2, 15), Mixer(mixup=0.2)

    def step(inputs: torch.Tensor) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(inputs), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def timed(fn) -> float:
        for _ in range(3):
            fn(0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for s in range(steps):
            fn(s)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / steps

    step_s = timed(lambda s: step(x / 127.5 - 1.0))
    aug_s = timed(lambda s: device_path(x, y, ra, mixer, (s, 0, 0)))
    return {"gpu": torch.cuda.get_device_name(dev), "gpu_batch": batch, "b16_step_ms": round(step_s * 1e3, 2),
            "device_path_ms": round(aug_s * 1e3, 2), "device_fraction_of_b16_step": round(aug_s / step_s, 4)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=64, help="images per batch on the CPU")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each path counts")
    ap.add_argument("--gpu-batch", type=int, default=128, help="B/16 batch on the GPU")
    ap.add_argument("--gpu-steps", type=int, default=10, help="timed steps on the GPU")
    args = ap.parse_args(argv)
    out = {"randaug": [2, 15], "mixup": 0.2, "img_size": SIZE, "images": args.images, **cpu_figures(args.images, args.rounds)}
    torch.set_num_threads(os.cpu_count() or 1)
    gpu = gpu_fraction(args.gpu_batch, args.gpu_steps) if torch.cuda.is_available() else {"device_fraction_of_b16_step": None}
    out.update(gpu, machine=machine.describe(), load_average=round(os.getloadavg()[0], 2))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
