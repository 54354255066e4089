"""The per-item path of the ingest, free of Beam: decode -> validate -> hash -> resize -> encode.

:func:`process_item` is what every Beam worker runs on each item, and what
``benchmarks/ingest.py`` measures.
"""
from __future__ import annotations

import dataclasses
import io
import threading
import warnings
from typing import Any, Mapping

import numpy as np
from PIL import Image

from pipelines import labels as label_ids
from pipelines.decode import BadImage, decode_image, rgbx_view
from pipelines.schema import make_key, text_uri
from pipelines.sources import SourceItem


@dataclasses.dataclass(frozen=True)
class ProcessOptions:
    size: int = 384
    max_long_side: int | None = None
    upscale: bool = False
    quality: int = 90
    store: str = "jpeg"
    max_megapixels: float = 89.0
    min_short_side: int = 0
    label_map: Mapping[str, int] | None = None  # None: accept every label
    names_by_id: Mapping[str, str] | None = None  # the label map's names by id, for integer labels

    @classmethod
    def from_config(cls, cfg, label_map: Mapping[str, int] | None) -> "ProcessOptions":
        return cls(
            size=cfg.size, max_long_side=cfg.max_long_side, upscale=cfg.upscale, quality=cfg.quality,
            store=cfg.store, max_megapixels=cfg.max_megapixels, min_short_side=cfg.min_short_side,
            label_map=dict(label_map) if label_map is not None else None,
            names_by_id=label_ids.names_by_id(label_map) if label_map is not None else None,
        )


def target_size(width: int, height: int, size: int, max_long_side: int | None, upscale: bool) -> tuple[int, int]:
    """Shorter side to ``size`` keeping the aspect ratio, never enlarging unless ``upscale``, longer side capped."""
    scale = size / min(width, height)
    if scale > 1.0 and not upscale:
        scale = 1.0
    if max_long_side is not None:
        scale = min(scale, max_long_side / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def resize(img: Image.Image, size: int, max_long_side: int | None = None, upscale: bool = False) -> Image.Image:
    new = target_size(img.width, img.height, size, max_long_side, upscale)
    if new == img.size:
        return img
    return resize_bicubic(img, new)


def resize_bicubic(img: Image.Image, new: tuple[int, int]) -> Image.Image:
    """Antialiased bicubic resize of an 8-bit RGB image to ``new`` = (width, height).

    torch's uint8 antialiased kernels were written to reproduce Pillow's filters (within one
    grey level of ``Image.resize(BICUBIC)``) and run several times faster;
    after draft-mode decoding, Pillow's resize was the largest cost of the ingest
    (figures: benchmarks/README.md).
    """
    if img.mode != "RGB":
        return img.resize(new, Image.Resampling.BICUBIC, reducing_gap=3.0)
    return Image.fromarray(np.array(_resize_pixels(_pixels(img), new)[..., :3]))


def encode(img: Image.Image, store: str, quality: int) -> tuple[bytes, str]:
    if store == "raw":
        return img.tobytes(), "raw"
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue(), "jpeg"


def resize_encode(img: Image.Image, opts: ProcessOptions) -> tuple[bytes, str, int, int]:
    """The output of one item: (bytes, format, width, height) of ``img`` resized per ``opts``.

    Byte for byte what ``encode(resize(img, ...), ...)`` gives, without the copies in
    between: the RGB pixels are read in place (:func:`_pixels`), resized into a
    reused buffer (:func:`_resize_pixels`) and the encoder reads them from there, so
    the encoded bytes are the only allocation per image.
    """
    new = target_size(img.width, img.height, opts.size, opts.max_long_side, opts.upscale)
    if img.mode != "RGB":
        out = resize(img, opts.size, opts.max_long_side, opts.upscale)
        data, fmt = encode(out, opts.store, opts.quality)
        return data, fmt, out.width, out.height
    pixels = _pixels(img)
    if new != img.size:
        pixels = _resize_pixels(pixels, new)
    if opts.store == "raw":
        return np.ascontiguousarray(pixels[..., :3]).tobytes(), "raw", new[0], new[1]
    if pixels.shape[2] == 4:
        # Pillow's RGBX is its own layout of RGB: wrapped without a copy, encoded as RGB.
        out = Image.frombuffer("RGBX", new, np.ascontiguousarray(pixels), "raw", "RGBX", 0, 1)
    else:
        out = Image.fromarray(np.ascontiguousarray(pixels))
    return encode(out, "jpeg", opts.quality)[0], "jpeg", new[0], new[1]


def _pixels(img: Image.Image) -> np.ndarray:
    """The pixels of an RGB image: a read-only (H, W, 4) view of Pillow's own memory when it has one.

    ``np.asarray(img)`` repacks Pillow's 4 bytes a pixel to 3, a copy that costs
    a third as much as the resize itself; the view (:func:`pipelines.decode.rgbx_view`) does not.
    """
    view = rgbx_view(img)
    return np.asarray(img) if view is None else view[0]  # the view's base keeps the export alive


_scratch = threading.local()


def _resize_pixels(pixels: np.ndarray, new: tuple[int, int]) -> np.ndarray:
    """Antialiased bicubic resize of (H, W, C) uint8 pixels to ``new`` = (width, height).

    The result is a view into this thread's scratch buffer, valid until the next call on the
    same thread. Writing into a preallocated channels-last tensor lets torch's uint8 AVX2
    kernel store pixels in their final interleaved order; a fresh result would come back
    channel-planar and need a transposing copy, and its first touch costs page faults.
    """
    import torch
    import torch.nn.functional as F

    width, height = new
    channels = pixels.shape[2]
    need = height * width * channels
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < need:
        buf = _scratch.buf = torch.empty(max(need, 1 << 20), dtype=torch.uint8)
    with warnings.catch_warnings():
        # Pillow's buffer is read-only; the kernel only reads it, so no copy is needed.
        warnings.simplefilter("ignore", UserWarning)
        x = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0)
    out = buf[:need].view(1, height, width, channels).permute(0, 3, 1, 2)
    with torch.no_grad():
        try:
            torch.ops.aten._upsample_bicubic2d_aa.out(x, [height, width], False, None, out=out)
        except (AttributeError, RuntimeError):  # the private out= overload moved: public op, then copy
            out.copy_(F.interpolate(x, size=(height, width), mode="bicubic", antialias=True))
    return out[0].permute(1, 2, 0).numpy()


def reject(uri: str, reason: str, detail: str) -> dict[str, Any]:
    """A quarantine row; its text is valid UTF-8 whatever the file's name was (:func:`~pipelines.schema.text_uri`)."""
    return {"_t": "rejected", "key": make_key(uri), "uri": text_uri(uri), "reason": reason, "detail": text_uri(detail)}


def process_item(item: SourceItem, opts: ProcessOptions) -> dict[str, Any]:
    """One item to a shard record (``_t == "record"``) or a quarantine record (``_t == "rejected"``).

    Only :class:`BadImage` is handled here; anything else propagates to the
    pipeline's dead-letter output, which records it as ``unexpected_error``.
    """
    from neardup import signatures

    try:
        if opts.label_map is not None:
            item = dataclasses.replace(item, labels=label_ids.resolve(item.labels, opts.label_map, opts.names_by_id or {}))
            unknown = [name for name in item.labels if name not in opts.label_map]
            if unknown:
                raise BadImage("unknown_label", f"{item.uri}: label(s) {unknown} not in the label map")
        data = item.read()
        img = decode_image(
            data,
            uri=item.uri,
            max_megapixels=opts.max_megapixels,
            draft_short_side=opts.size,
            draft_max_long_side=opts.max_long_side,
            min_short_side=opts.min_short_side,
        )
    except BadImage as exc:
        return reject(item.uri, exc.reason, exc.detail)
    content_hash = signatures.content_hash(img)
    phash = signatures.corpus_codes(img)  # both directions of the dedup rule (neardup.index)
    image, fmt, width, height = resize_encode(img, opts)
    return {
        "_t": "record",
        "key": make_key(item.uri),
        "uri": item.uri,
        "labels": tuple(dict.fromkeys(item.labels)),
        "image": image,
        "format": fmt,
        "height": height,
        "width": width,
        "content_hash": content_hash,
        "phash": phash,
    }
