"""From Arrow shards to torch batches: the paper's input pipeline for training and evaluation.

Train input (REFERENCE.md, official fine-tuning configs): Inception crop (area 0.05-1) →
resize → random horizontal flip → ``(x - 127.5) / 127.5``. Eval input: plain resize.

The dataset is map-style over a :class:`pipelines.schema.ShardSet`, so a
``DistributedSampler`` gives every Ray Train worker a disjoint, reshuffled slice per epoch
straight from the memory-mapped shards. Rows listed in the shard set's removal list
(``removed.jsonl``, written by ``jobs/dedup.py``) are never served.
"""
from __future__ import annotations

import math
import zlib
from typing import Callable, Literal, Sequence

import numpy as np
import torch
from PIL import Image

from common.config import ConfigError
from pipelines.schema import ShardSet, decode_row_image

Transform = Callable[[np.ndarray, np.random.Generator], np.ndarray]
LabelMode = Literal["single", "multi"]


def encode_target(labels: Sequence[int], label_mode: LabelMode, num_classes: int, *, row: str) -> int | np.ndarray:
    """A row's ``labels`` as the loss expects them: the class index (``"single"``, softmax) or a
    multi-hot float32 vector (``"multi"``, sigmoid). Both loaders use it, so both refuse a row
    that does not have exactly one label in single-label mode instead of keeping its first."""
    labels = [int(x) for x in labels]
    if label_mode == "single":
        if len(labels) != 1:
            raise ConfigError(
                f"{row}: has {len(labels)} labels but label_mode='single'; "
                "use label_mode='multi' (sigmoid loss) for multi-label corpora"
            )
        return labels[0]
    y = np.zeros(num_classes, np.float32)
    y[labels] = 1.0
    return y


def value_range(arr: np.ndarray) -> np.ndarray:
    """uint8 HWC → float32 CHW in [-1, 1], the range vitcore models expect."""
    return ((arr.astype(np.float32) - 127.5) / 127.5).transpose(2, 0, 1)


def inception_crop(
    img: Image.Image, size: int, rng: np.random.Generator, area: tuple[float, float] = (0.05, 1.0)
) -> Image.Image:
    """Random-area, random-aspect crop resized to ``size`` (Szegedy et al.; the ViT train input)."""
    w, h = img.size
    for _ in range(10):
        target = rng.uniform(*area) * w * h
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            return img.resize((size, size), Image.BILINEAR, box=(x, y, x + cw, y + ch))
    side = min(w, h)  # fall back to a central square, as the TF implementation does
    x, y = (w - side) // 2, (h - side) // 2
    return img.resize((size, size), Image.BILINEAR, box=(x, y, x + side, y + side))


def to_uint8_chw(arr: np.ndarray) -> np.ndarray:
    """uint8 HWC → uint8 CHW: a quarter of float32's bytes to ship between processes and to the
    GPU; :func:`normalize` finishes the job on the device."""
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def normalize(x: torch.Tensor) -> torch.Tensor:
    """uint8 CHW batch → float in [-1, 1] (a no-op for batches that are already float)."""
    return x if x.is_floating_point() else x.float().sub_(127.5).div_(127.5)


def train_transform(size: int, *, flip: bool = True, min_area: float = 0.05, uint8: bool = False) -> Transform:
    """Inception crop covering at least ``min_area`` of the image (1.0: plain resize), then a
    random flip. VTAB-style tasks where a flip or a crop changes the label turn them off.
    ``uint8=True`` returns uint8 CHW for :func:`normalize` to finish on the device."""
    if not 0.0 < min_area <= 1.0:
        raise ValueError(f"min_area must be in (0, 1], got {min_area}")

    def apply(arr: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        img = Image.fromarray(arr)
        if min_area < 1.0:
            img = inception_crop(img, size, rng, area=(min_area, 1.0))
        else:
            img = img.resize((size, size), Image.BILINEAR)
        if flip and rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        return to_uint8_chw(np.asarray(img)) if uint8 else value_range(np.asarray(img))

    return apply


def eval_transform(size: int, *, uint8: bool = False) -> Transform:
    def apply(arr: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        out = np.asarray(Image.fromarray(arr).resize((size, size), Image.BILINEAR))
        return to_uint8_chw(out) if uint8 else value_range(out)

    return apply


class ShardImageDataset(torch.utils.data.Dataset):
    """Rows of a shard set as ``(image CHW float32, target)``.

    ``target`` is the class index for ``label_mode="single"`` (softmax loss) or a multi-hot
    float vector for ``"multi"`` (sigmoid loss, JFT-style multi-label corpora).
    """

    def __init__(
        self,
        shards: str | ShardSet,
        transform: Transform,
        *,
        label_mode: LabelMode = "single",
        rows: np.ndarray | None = None,
        seed: int = 0,
    ):
        self.shards = shards if isinstance(shards, ShardSet) else ShardSet(shards)
        self.transform = transform
        self.label_mode = label_mode
        self.num_classes = len(self.shards.label_map)
        self.rows = np.arange(len(self.shards)) if rows is None else np.asarray(rows)
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.rows)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, i: int):
        index = int(self.rows[i])
        record = self.shards[index]
        arr = decode_row_image(record)
        # Per-item, per-epoch generator: augmentations are reproducible whatever the worker layout.
        rng = np.random.default_rng((self.seed, self.epoch, index))
        x = torch.from_numpy(self.transform(arr, rng))
        y = encode_target(record["labels"], self.label_mode, self.num_classes, row=record["source"])
        return x, (y if isinstance(y, int) else torch.from_numpy(y))


def is_held_out(key: str, fraction: float) -> bool:
    """Whether the row with this key is held out. Decided by the key alone, so the map-style and
    the Ray Data loaders, every worker layout and every re-run agree on the split."""
    return zlib.crc32(key.encode("utf-8")) % 10_000 < round(fraction * 10_000)


def holdout_mask(keys: Sequence[str], fraction: float) -> np.ndarray:
    return np.fromiter((is_held_out(k, fraction) for k in keys), dtype=bool, count=len(keys))


def shard_keys(shards: ShardSet) -> list[str]:
    """Keys of the retained rows, in ``ShardSet`` index order (a memory-mapped column read)."""
    return [k for batch in shards.iter_batches(columns=["key"]) for k in batch.column(0).to_pylist()]


class DecodeBatch:
    """Ray Data ``map_batches`` step: shard rows → model-ready images and targets, dropping held-out rows.

    Run as a data task, it moves decoding and augmentation off the training workers (Ray Data's
    disaggregated preprocessing). Images leave as uint8 (a quarter of float32's bytes through the
    object store); the trainer applies :func:`normalize`. Augmentation is drawn from fresh
    entropy on each pass, since a streaming pipeline does not know which epoch it is serving.
    """

    def __init__(self, size: int, *, label_mode: LabelMode, num_classes: int,
                 holdout: float, train: bool = True):
        self.transform = train_transform(size, uint8=True) if train else eval_transform(size, uint8=True)
        self.label_mode, self.num_classes, self.holdout, self.train = label_mode, num_classes, holdout, train

    def __call__(self, batch: dict) -> dict:
        rng = np.random.default_rng()
        images, targets = [], []
        for key, data, fmt, h, w, labels in zip(batch["key"], batch["image"], batch["format"], batch["height"],
                                                 batch["width"], batch["labels"]):
            if is_held_out(str(key), self.holdout) == self.train:
                continue
            images.append(self.transform(decode_row_image(bytes(data), str(fmt), int(h), int(w)), rng))
            targets.append(encode_target(labels, self.label_mode, self.num_classes, row=f"row {key}"))
        if not images:
            return {"image": np.zeros((0, 3, 1, 1), np.uint8), "label": np.zeros((0,), np.int64)}
        return {"image": np.stack(images), "label": np.asarray(targets)}


def split_rows(rows: np.ndarray | int, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of row indices (or ``range(rows)``) into (train, held-out), e.g. the
    paper's held-out part of the training set for choosing the learning rate."""
    rows = np.arange(rows) if isinstance(rows, (int, np.integer)) else np.asarray(rows)
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    perm = np.random.default_rng(seed).permutation(len(rows))
    n_hold = int(round(len(rows) * holdout))
    return rows[np.sort(perm[n_hold:])], rows[np.sort(perm[:n_hold])]
