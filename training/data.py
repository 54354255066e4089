"""From Arrow shards to torch batches: the paper's input pipeline for training and evaluation.

Train input (the official ViT code's fine-tuning configs): Inception crop (area 0.05-1) →
resize → random horizontal flip → ``(x - 127.5) / 127.5``. Eval input: plain resize.

Two ways to run it. Per item on the CPU: :class:`ShardImageDataset` with :func:`train_transform`.
Split, to feed a GPU: :class:`ShardCropDataset` (or :class:`DecodeBatch` with a canvas) decodes and
copies each crop's pixels into a uint8 batch, and :func:`training.augment.crop_resize_flip` does the
resize, flip and value range for the batch on the device. Both draw the same boxes and flips.

The dataset is map-style over a :class:`pipelines.schema.ShardSet`, so a
``DistributedSampler`` gives every Ray Train worker a disjoint, reshuffled slice per epoch
straight from the memory-mapped shards. Rows listed in the shard set's removal list
(``removed.jsonl``, written by ``jobs/dedup.py``) are never served.
"""
from __future__ import annotations

import bisect
import hashlib
import math
import zlib
from typing import Callable, Literal, Sequence

import numpy as np
import torch
from PIL import Image

try:
    import simplejpeg
except ImportError:  # a declared dependency; without it Pillow decodes every JPEG
    simplejpeg = None

import pyarrow.compute as pc

from common.config import ConfigError
from pipelines.schema import ShardSet, decode_row_image
from training.randaugment import RandAugment

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
                "pre-train a multi-label corpus with --loss sigmoid"
            )
        return labels[0]
    y = np.zeros(num_classes, np.float32)
    y[labels] = 1.0
    return y


def value_range(arr: np.ndarray) -> np.ndarray:
    """uint8 HWC → float32 CHW in [-1, 1], the range vitcore models expect."""
    return ((arr.astype(np.float32) - 127.5) / 127.5).transpose(2, 0, 1)


def inception_box(w: int, h: int, rng: np.random.Generator,
                  area: tuple[float, float] = (0.05, 1.0)) -> tuple[int, int, int, int]:
    """``(x0, y0, x1, y1)`` of a random-area, random-aspect crop of a ``w`` x ``h`` image
    (Szegedy et al.; the ViT train input). Both train paths draw their boxes here, so one
    generator state gives one box whichever path resizes it."""
    for _ in range(10):
        target = rng.uniform(*area) * w * h
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            return x, y, x + cw, y + ch
    side = min(w, h)  # fall back to a central square, as the TF implementation does
    x, y = (w - side) // 2, (h - side) // 2
    return x, y, x + side, y + side


def inception_crop(
    img: Image.Image, size: int, rng: np.random.Generator, area: tuple[float, float] = (0.05, 1.0)
) -> Image.Image:
    """Random-area, random-aspect crop resized to ``size`` (Szegedy et al.; the ViT train input)."""
    return img.resize((size, size), Image.BILINEAR, box=inception_box(*img.size, rng, area))


def to_uint8_chw(arr: np.ndarray) -> np.ndarray:
    """uint8 HWC → uint8 CHW: a quarter of float32's bytes to ship between processes and to the
    GPU; :func:`normalize` finishes the job on the device."""
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def normalize(x: torch.Tensor) -> torch.Tensor:
    """uint8 CHW batch → float in [-1, 1] (a no-op for batches that are already float)."""
    return x if x.is_floating_point() else x.float().sub_(127.5).div_(127.5)


def train_transform(size: int, *, flip: bool = True, min_area: float = 0.05, uint8: bool = False,
                    randaug: RandAugment | None = None) -> Transform:
    """Inception crop covering at least ``min_area`` of the image (1.0: plain resize), then a
    random flip, then ``randaug`` (Pillow's ops, drawn after the crop and flip, so that without it
    the draws are as before). VTAB-style tasks where a flip or a crop changes the label turn them
    off. ``uint8=True`` returns uint8 CHW for :func:`normalize` to finish on the device."""
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
        if randaug is not None:
            img = randaug.pil(img, rng)
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


#: DCT scales (1/d) the crop loaders decode at: libjpeg-turbo's 3/8 to 7/8 IDCTs have no SIMD and
#: run slower than a full-scale decode (benchmarks/README.md), so only halvings are worth taking.
DCT_DENOMS = (8, 4, 2, 1)


def dct_denom(min_side: float, size: int) -> int:
    """The largest ``d`` of :data:`DCT_DENOMS` that keeps ``min_side / d`` at least ``size`` pixels:
    the crop still reaches the model at full resolution, the decoder does a fraction of the IDCT."""
    return next(d for d in DCT_DENOMS if min_side >= size * d or d == 1)


def _tap_margin(length: float, size: int) -> int:
    """Pixels beyond a box that PIL's bilinear filter reads when it resizes ``length`` to ``size``."""
    return math.ceil(max(length / size, 1.0) + 0.5)


def canvas_shape(shards: ShardSet, size: int, *, min_area: float = 0.05) -> tuple[int, int]:
    """(height, width) of a canvas that holds the copied region of any crop of any row.

    A crop's aspect is within 3/4..4/3, so its long side is at most 4/3 of its short side, which
    the DCT scale keeps under ``2 * size`` for JPEGs; raw rows are copied at full scale.
    """
    hc = wc = 1
    for batch in shards.iter_batches(columns=["height", "width", "format"]):
        h = batch.column(0).to_numpy().astype(np.int64)
        w = batch.column(1).to_numpy().astype(np.int64)
        jpeg = np.asarray(batch.column(2).to_pylist()) == "jpeg"
        if min_area >= 1.0:
            d = np.array([dct_denom(m, size) if j else 1 for m, j in zip(np.minimum(h, w), jpeg)])
            rh, rw = -(-h // d), -(-w // d)
        else:
            ch, cw = np.minimum(h, w * 4 // 3 + 2), np.minimum(w, h * 4 // 3 + 2)
            cap = math.ceil(size * 8 / 3) + 2
            ch, cw = np.where(jpeg, np.minimum(ch, cap), ch), np.where(jpeg, np.minimum(cw, cap), cw)
            margin = np.ceil(np.maximum(np.maximum(ch, cw) / size, 1.0) + 0.5).astype(np.int64)
            rh, rw = np.minimum(h, ch + 2 * margin), np.minimum(w, cw + 2 * margin)
        if len(h):
            hc, wc = max(hc, int(rh.max())), max(wc, int(rw.max()))
    return hc, wc


def _decode_at_scale(data, fmt: str, h: int, w: int, d: int) -> tuple[np.ndarray, int]:
    """A row's pixels decoded at scale 1/d (or 1/1 where the fast decoder refuses), and that d."""
    if fmt == "jpeg" and simplejpeg is not None:
        sh, sw = -(-h // d), -(-w // d)
        try:
            arr = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=sh, min_width=sw)
            if arr.shape[:2] == (sh, sw):
                return arr, d
        except (ValueError, RuntimeError):
            pass  # anything the strict decoder refuses goes through Pillow, as in the ingest
    return decode_row_image(bytes(data), fmt, h, w), 1


def paste_crop(data, fmt: str, h: int, w: int, box: tuple[int, int, int, int], size: int,
               slot: np.ndarray) -> tuple[tuple[float, float, float, float], tuple[int, int]]:
    """Decode a row at the DCT scale its box allows and copy the pixels under the box, plus the
    margin the resize filter reads, into ``slot`` (a canvas, HWC). Returns the box in the slot's
    pixel coordinates and the copied extent (height, width), as :func:`training.augment.crop_resize_flip`
    takes them."""
    x0, y0, x1, y1 = box
    d = dct_denom(min(x1 - x0, y1 - y0), size) if fmt == "jpeg" else 1
    arr, d = _decode_at_scale(data, fmt, h, w, d)
    bx0, by0, bx1, by1 = x0 / d, y0 / d, x1 / d, y1 / d
    mx, my = _tap_margin(bx1 - bx0, size), _tap_margin(by1 - by0, size)
    rx0, ry0 = max(0, int(bx0) - mx), max(0, int(by0) - my)
    rx1, ry1 = min(arr.shape[1], math.ceil(bx1) + mx), min(arr.shape[0], math.ceil(by1) + my)
    if ry1 - ry0 > slot.shape[0] or rx1 - rx0 > slot.shape[1]:
        raise ValueError(f"crop region {ry1 - ry0}x{rx1 - rx0} does not fit the canvas {slot.shape[0]}x{slot.shape[1]}; "
                         "build the canvas with training.data.canvas_shape for these shards")
    slot[:ry1 - ry0, :rx1 - rx0] = arr[ry0:ry1, rx0:rx1]
    return (bx0 - rx0, by0 - ry0, bx1 - rx0, by1 - ry0), (ry1 - ry0, rx1 - rx0)


def _shared_uint8(shape: tuple[int, ...]) -> torch.Tensor:
    """An empty uint8 tensor; in a DataLoader worker, in shared memory from the start, so that the
    hand-off to the trainer process does not copy it again (as ``default_collate`` does)."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=torch.uint8)
    return _new_shared_uint8(shape)


def _new_shared_uint8(shape: tuple[int, ...]) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared(int(np.prod(shape)))
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


#: Canvas batches each DataLoader process keeps in shared memory for reuse: its ``prefetch_factor``
#: (2) batches in flight, the one the trainer holds, and one spare. A fresh shared segment per batch
#: costs a page fault per 4 KB on first write (the hand-off row of benchmarks/README.md).
CANVAS_RING = 4


class CanvasSlot:
    """A DataLoader process's claim on one canvas of its ring, travelling with the batch.

    The trainer process calls :meth:`release` once it no longer reads the batch's canvas (after the
    host-to-device copy, or after the step on CPU); until then the worker leaves the canvas alone and,
    should it need one, takes fresh shared memory instead. Not a tensor, so ``pin_memory`` passes it
    through untouched; it holds the ring's memory so that the trainer process keeps it mapped.
    """

    def __init__(self, memory: torch.Tensor, flag: int):
        self.memory, self.flag = memory, flag

    @property
    def key(self) -> tuple[int, int]:
        return self.memory.untyped_storage().data_ptr(), self.flag

    def release(self) -> None:
        self.memory[self.flag] = 1


class _CanvasRing:
    """``depth`` canvas batches in one block of shared memory, made on first use in a DataLoader
    process, followed by a free flag per canvas that :meth:`CanvasSlot.release` sets from the
    trainer process."""

    def __init__(self, shape: tuple[int, ...], depth: int):
        self.per, self.shape = int(np.prod(shape)), shape
        self.memory = _new_shared_uint8((depth * self.per + depth,))
        self.canvases = self.memory[:depth * self.per].view(depth, *shape)
        self.free = self.memory[depth * self.per:]
        self.free.fill_(1)
        self.next = 0

    def take(self, n: int) -> tuple[torch.Tensor, CanvasSlot | None]:
        i = self.next
        self.next = (i + 1) % len(self.free)
        if n > self.shape[0] or not self.free[i]:
            return _shared_uint8((n, *self.shape[1:])), None
        self.free[i] = 0
        return self.canvases[i, :n], CanvasSlot(self.memory, len(self.canvases) * self.per + i)


class _RingBatch(dict):
    """A crop batch whose canvas lies in a ring. Pickled to the trainer process as the ring's memory
    (one file descriptor to pass, whose mapping the trainer reuses) and the small fields as bytes:
    a tensor each would cost a new shared segment and a descriptor each, per batch."""

    def __reduce__(self):
        image, slot = self["image"], self["slot"]
        small = {k: v.numpy() for k, v in self.items() if k not in ("image", "slot")}
        return _unpack_ring_batch, (slot.memory, slot.flag, image.storage_offset(), tuple(image.shape), small)


def _unpack_ring_batch(memory: torch.Tensor, flag: int, offset: int, shape: tuple[int, ...], small: dict) -> dict:
    image = memory[offset:offset + int(np.prod(shape))].view(shape)
    return {"image": image, **{k: torch.from_numpy(v) for k, v in small.items()}, "slot": CanvasSlot(memory, flag)}


def release_canvases(batches):
    """Yield crop batches, handing each one's canvas back to its DataLoader process when the next
    batch is asked for: the consumer must be done with a batch's ``image`` by then."""
    kept: dict[tuple[int, int], CanvasSlot] = {}
    for batch in batches:
        yield batch
        slot = batch.get("slot") if isinstance(batch, dict) else None
        if slot is not None:
            # Kept alive, the trainer process reuses its mapping of the canvas (torch's shared cache).
            kept[slot.key] = slot
            slot.release()


class _ShardColumns:
    """Zero-copy numpy views of one memory-mapped shard's columns, to read a row without a dict."""

    def __init__(self, table):
        self.chunks = []
        starts = [0]
        for image, fmt, h, w, labels in zip(*(table.column(c).chunks for c in
                                              ("image", "format", "height", "width", "labels"))):
            bufs = image.buffers()
            offsets = np.frombuffer(bufs[1], np.int32)[image.offset:image.offset + len(image) + 1]
            self.chunks.append((offsets, np.frombuffer(bufs[2], np.uint8),
                                pc.equal(fmt, "raw").to_numpy(zero_copy_only=False),
                                h.to_numpy(), w.to_numpy(), labels.offsets.to_numpy(), labels.values.to_numpy()))
            starts.append(starts[-1] + len(image))
        self.starts = starts

    def row(self, local: int):
        """(image bytes view, format, height, width, label ids) of row ``local``."""
        c = bisect.bisect_right(self.starts, local) - 1
        offsets, data, raw, h, w, loff, lval = self.chunks[c]
        j = local - self.starts[c]
        return (data[offsets[j]:offsets[j + 1]], "raw" if raw[j] else "jpeg", int(h[j]), int(w[j]),
                lval[loff[j]:loff[j + 1]])


class ShardCropDataset(ShardImageDataset):
    """Rows of a shard set as crop batches for :func:`training.augment.crop_resize_flip`.

    The CPU half of the train input: per row, the Inception-crop box and the flip are drawn from
    the same per-item, per-epoch generator as :class:`ShardImageDataset` with
    :func:`train_transform` draws them (so resuming at a step gives the same boxes), the JPEG is
    decoded at the DCT scale the box allows, and the pixels under the box are copied into one
    uint8 canvas per batch. Nothing per pixel beyond decode and copy happens here.

    Fetched a batch at a time (``__getitems__``): build the DataLoader with
    ``collate_fn=collate_crops``. A batch is a dict of :data:`training.augment.CROP_FIELDS`.
    ``flip=False`` / ``min_area=1.0`` are the VTAB exclusions, as in :func:`train_transform`;
    both together are the eval input (a plain resize).
    """

    def __init__(self, shards: str | ShardSet, size: int, *, flip: bool = True, min_area: float = 0.05,
                 canvas: tuple[int, int] | None = None, label_mode: LabelMode = "single",
                 rows: np.ndarray | None = None, seed: int = 0, ring: int = CANVAS_RING):
        if not 0.0 < min_area <= 1.0:
            raise ValueError(f"min_area must be in (0, 1], got {min_area}")
        super().__init__(shards, None, label_mode=label_mode, rows=rows, seed=seed)
        self.size, self.flip, self.min_area = size, flip, min_area
        self.canvas = canvas or canvas_shape(self.shards, size, min_area=min_area)
        self._retained = [self.shards.retained_rows(i) for i in range(len(self.shards.shards))]
        self._starts = np.cumsum([0] + [len(r) for r in self._retained]).tolist()
        self._columns: dict[int, _ShardColumns] = {}
        self.ring, self._ring = ring, None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_columns"], state["_ring"] = {}, None
        return state

    def _canvas(self, n: int) -> tuple[torch.Tensor, CanvasSlot | None]:
        """A batch canvas: in a DataLoader process, from its ring (made at the first batch's size)."""
        if torch.utils.data.get_worker_info() is None or not self.ring:
            return _shared_uint8((n, *self.canvas, 3)), None
        if self._ring is None:
            self._ring = _CanvasRing((n, *self.canvas, 3), self.ring)
        return self._ring.take(n)

    def _row(self, index: int):
        shard = bisect.bisect_right(self._starts, index) - 1
        cols = self._columns.get(shard)
        if cols is None:
            cols = self._columns[shard] = _ShardColumns(self.shards.open_shard(shard))
        return cols.row(int(self._retained[shard][index - self._starts[shard]]))

    def __getitem__(self, i: int) -> dict:
        return self.__getitems__([i])

    def __getitems__(self, positions: Sequence[int]) -> dict:
        n = len(positions)
        image, slot = self._canvas(n)
        canvas = image.numpy()
        box, extent, flip = np.empty((n, 4), np.float32), np.empty((n, 2), np.int64), np.zeros(n, bool)
        labels = []
        for k, p in enumerate(positions):
            index = int(self.rows[p])
            data, fmt, h, w, ids = self._row(index)
            # Per-item, per-epoch generator, drawn in train_transform's order: box, then flip.
            rng = np.random.default_rng((self.seed, self.epoch, index))
            b = inception_box(w, h, rng, (self.min_area, 1.0)) if self.min_area < 1.0 else (0, 0, w, h)
            flip[k] = self.flip and rng.random() < 0.5
            box[k], extent[k] = paste_crop(data, fmt, h, w, b, self.size, canvas[k])
            if self.label_mode == "single" and len(ids) == 1:
                labels.append(int(ids[0]))
            else:
                labels.append(encode_target(ids.tolist(), self.label_mode, self.num_classes,
                                            row=self.shards[index]["source"]))
        label = torch.from_numpy(np.stack(labels)) if self.label_mode == "multi" else torch.tensor(labels)
        out = {"image": image, "box": torch.from_numpy(box), "extent": torch.from_numpy(extent),
               "flip": torch.from_numpy(flip), "label": label}
        return out if slot is None else _RingBatch({**out, "slot": slot})


def collate_crops(batch: dict) -> dict:
    """The DataLoader ``collate_fn`` for :class:`ShardCropDataset`: its batches come collated."""
    return batch


def is_held_out(key: str, fraction: float) -> bool:
    """Whether the row with this key is held out. Decided by the key alone, so the map-style and
    the Ray Data loaders, every worker layout and every re-run agree on the split."""
    return zlib.crc32(key.encode("utf-8")) % 10_000 < round(fraction * 10_000)


def holdout_mask(keys: Sequence[str], fraction: float) -> np.ndarray:
    return np.fromiter((is_held_out(k, fraction) for k in keys), dtype=bool, count=len(keys))


# Salts the subset hash, so that it is drawn independently of the held-out split's.
SUBSET_SALT = b"vitscale-subset:"


def in_subset(key: str, fraction: float) -> bool:
    """Whether the row with this key is in the nested ``fraction`` subset: a stable hash of the key
    alone, below ``fraction``. So every smaller subset lies inside every larger one, and every
    run, loader and worker layout picks the same rows (the data-size axis of Figure 4)."""
    if fraction >= 1.0:
        return True
    digest = hashlib.sha256(SUBSET_SALT + key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2.0**64


def subset_mask(keys: Sequence[str], fraction: float) -> np.ndarray:
    if fraction >= 1.0:
        return np.ones(len(keys), dtype=bool)
    return np.fromiter((in_subset(k, fraction) for k in keys), dtype=bool, count=len(keys))


def training_mask(keys: Sequence[str], holdout: float, fraction: float = 1.0) -> np.ndarray:
    """The rows pre-training trains on: not held out, and in the ``fraction`` subset. The held-out
    rows are the same at every fraction, and in no subset."""
    return ~holdout_mask(keys, holdout) & subset_mask(keys, fraction)


def shard_keys(shards: ShardSet) -> list[str]:
    """Keys of the retained rows, in ``ShardSet`` index order (a memory-mapped column read)."""
    return [k for batch in shards.iter_batches(columns=["key"]) for k in batch.column(0).to_pylist()]


def label_counts(shards: ShardSet) -> tuple[int, int]:
    """(rows with no label, rows with several) among the retained rows (a memory-mapped column read)."""
    none = several = 0
    for batch in shards.iter_batches(columns=["labels"]):
        n = pc.fill_null(pc.list_value_length(batch.column(0)), 0)
        none += pc.sum(pc.equal(n, 0)).as_py() or 0
        several += pc.sum(pc.greater(n, 1)).as_py() or 0
    return none, several


def check_labelled(shards: ShardSet, field: str, *, unlabelled_fix: str, several_fix: str | None) -> None:
    """Refuse, in one line naming ``field`` and the fix, a shard set a classifier cannot learn or be scored on:
    no labels at all, or, for a single-label one (``several_fix`` given), a row without one or with several."""
    rows = len(shards)
    none, several = label_counts(shards)
    where = f"{field}: {shards.directory}"
    if rows and (none == rows or not shards.label_map):
        raise ConfigError(f"{where} is unlabelled (none of its {rows} rows has a label); {unlabelled_fix}")
    if none and several_fix is not None:
        raise ConfigError(f"{where}: {none} of its {rows} rows have no label, and a classifier needs one a row; "
                          f"{unlabelled_fix}")
    if several and several_fix is not None:
        raise ConfigError(f"{where}: {several} of its {rows} rows have several labels; {several_fix}")


class DecodeBatch:
    """Ray Data ``map_batches`` step: shard rows → model-ready images and targets, dropping held-out rows.

    Run as a data task, it moves decoding and augmentation off the training workers (Ray Data's
    disaggregated preprocessing). Images leave as uint8 (a quarter of float32's bytes through the
    object store); the trainer applies :func:`normalize`. Augmentation is drawn from fresh
    entropy on each pass, since a streaming pipeline does not know which epoch it is serving.

    With ``canvas`` (from :func:`canvas_shape`) it does only the CPU half, as
    :class:`ShardCropDataset` does: batches of :data:`training.augment.CROP_FIELDS` for
    :func:`training.augment.crop_resize_flip` on the device. The canvas is fixed so that Ray Data
    can re-batch rows from different tasks.
    """

    def __init__(self, size: int, *, label_mode: LabelMode, num_classes: int,
                 holdout: float, train: bool = True, canvas: tuple[int, int] | None = None, fraction: float = 1.0,
                 randaug: RandAugment | None = None):
        self.transform = train_transform(size, uint8=True, randaug=randaug) if train else eval_transform(size, uint8=True)
        self.label_mode, self.num_classes, self.holdout, self.train = label_mode, num_classes, holdout, train
        self.size, self.canvas, self.fraction = size, canvas, fraction

    def _keeps(self, key: str) -> bool:
        if is_held_out(key, self.holdout):
            return not self.train
        return self.train and in_subset(key, self.fraction)

    def __call__(self, batch: dict) -> dict:
        rng = np.random.default_rng()
        keep = [i for i, key in enumerate(batch["key"]) if self._keeps(str(key))]
        targets = [encode_target(batch["labels"][i], self.label_mode, self.num_classes, row=f"row {batch['key'][i]}")
                   for i in keep]
        label = np.asarray(targets) if targets else np.zeros((0,), np.int64)
        if self.canvas is not None:
            return {**self._crops(batch, keep, rng), "label": label}
        if not keep:
            return {"image": np.zeros((0, 3, 1, 1), np.uint8), "label": label}
        images = [self.transform(decode_row_image(bytes(batch["image"][i]), str(batch["format"][i]),
                                                  int(batch["height"][i]), int(batch["width"][i])), rng)
                  for i in keep]
        return {"image": np.stack(images), "label": label}

    def _crops(self, batch: dict, keep: list[int], rng: np.random.Generator) -> dict:
        n = len(keep)
        image = np.empty((n, *self.canvas, 3), np.uint8)
        box, extent, flip = np.empty((n, 4), np.float32), np.empty((n, 2), np.int64), np.zeros(n, bool)
        for k, i in enumerate(keep):
            h, w, fmt = int(batch["height"][i]), int(batch["width"][i]), str(batch["format"][i])
            b = inception_box(w, h, rng) if self.train else (0, 0, w, h)
            flip[k] = self.train and rng.random() < 0.5
            box[k], extent[k] = paste_crop(batch["image"][i], fmt, h, w, b, self.size, image[k])
        return {"image": image, "box": box, "extent": extent, "flip": flip}


def split_rows(rows: np.ndarray | int, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of row indices (or ``range(rows)``) into (train, held-out), e.g. the
    paper's held-out part of the training set for choosing the learning rate."""
    rows = np.arange(rows) if isinstance(rows, (int, np.integer)) else np.asarray(rows)
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    perm = np.random.default_rng(seed).permutation(len(rows))
    n_hold = int(round(len(rows) * holdout))
    return rows[np.sort(perm[n_hold:])], rows[np.sort(perm[:n_hold])]
