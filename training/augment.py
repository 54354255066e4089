"""The train input's per-pixel half, batched on whatever device the batch is on.

The CPU side (:class:`training.data.ShardCropDataset`, :class:`training.data.DecodeBatch` with a
canvas) decodes each image, draws its Inception-crop box and flip, and copies the pixels under the
box, untouched, into a fixed uint8 canvas. :func:`crop_resize_flip` does the rest for the whole
batch: resize each box to ``size``, flip, and map to ``[-1, 1]``.

The resize is PIL's bilinear filter, the one :func:`training.data.inception_crop` applies per
item: a triangle whose support widens with the downscale factor, so that a large crop is
antialiased rather than point-sampled (``grid_sample`` would alias a 1.5x reduction). The filter
is separable, so a batch is two batched matrix products with per-sample weight matrices; a flip
is the horizontal matrix's rows reversed.
"""
from __future__ import annotations

import torch

from training.randaugment import RandAugment

#: The fields of a crop batch, as both loaders yield them (uint8 canvas, float boxes, ...).
CROP_FIELDS = ("image", "box", "extent", "flip", "label")


def resample_weights(start: torch.Tensor, stop: torch.Tensor, extent: torch.Tensor, length: int,
                     size: int) -> torch.Tensor:
    """(B, size, length) weights of PIL's bilinear resample of ``[start, stop)`` to ``size`` pixels.

    ``start``/``stop`` are per-sample float positions along one axis of the canvas; taps at or
    beyond ``extent`` (the copied pixels' edge) weigh nothing, as PIL clamps taps to the image.
    """
    scale = (stop - start) / size
    support = scale.clamp(min=1.0)
    centre = start[:, None] + (torch.arange(size, device=start.device, dtype=start.dtype) + 0.5) * scale[:, None]
    taps = torch.arange(length, device=start.device, dtype=start.dtype)
    w = (1.0 - ((taps[None, None, :] + 0.5 - centre[:, :, None]) / support[:, None, None]).abs()).clamp(min=0.0)
    w = w * (taps[None, None, :] < extent[:, None, None])
    return w / w.sum(dim=2, keepdim=True)


def crop_resize_flip(image: torch.Tensor, box: torch.Tensor, extent: torch.Tensor, flip: torch.Tensor,
                     size: int) -> torch.Tensor:
    """uint8 canvases (B, H, W, 3) → float (B, 3, size, size) in ``[-1, 1]``, on ``image.device``.
    The arguments are :func:`crop_pixels`'s."""
    # The official code's value range: (x - 127.5) / 127.5. The weights are convex, so the
    # clamp only removes float rounding above 255.
    return crop_pixels(image, box, extent, flip, size).sub_(127.5).div_(127.5).clamp_(-1.0, 1.0).contiguous()


def crop_pixels(image: torch.Tensor, box: torch.Tensor, extent: torch.Tensor, flip: torch.Tensor,
                size: int) -> torch.Tensor:
    """uint8 canvases (B, H, W, 3) → float (B, 3, size, size) pixel values, not rounded, on ``image.device``.

    Args:
        image: the canvases; only ``[:extent_h, :extent_w]`` of each is read.
        box: (B, 4) float ``x0, y0, x1, y1`` of each crop in its canvas's pixel coordinates.
        extent: (B, 2) ``height, width`` of the pixels copied into each canvas.
        flip: (B,) bool, mirror left-right after the crop.
        size: output side in pixels.
    """
    dev = image.device
    box = box.to(dev, torch.float32)
    extent = extent.to(dev, torch.float32)
    b, h, w, _ = image.shape
    wy = resample_weights(box[:, 1], box[:, 3], extent[:, 0], h, size)
    wx = resample_weights(box[:, 0], box[:, 2], extent[:, 1], w, size)
    wx = torch.where(flip.to(dev).bool()[:, None, None], wx.flip(1), wx)
    rows = torch.bmm(wy, image.reshape(b, h, w * 3).float()).view(b, size, w, 3)
    return torch.einsum("bjx,bixc->bcij", wx, rows)


def device_batch(batch: dict, size: int, device: torch.device | str, randaug: RandAugment | None = None,
                 key: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """A crop batch from either loader → ``(x, y)`` on ``device``: the uint8 canvases cross to the
    device, then :func:`crop_resize_flip` runs there. With ``randaug``, the crops are rounded to
    whole pixel values, as the per-item path's Pillow resize leaves them, and augmented per image
    with choices keyed by ``key`` (step, rank, micro-batch) before the value range."""
    device = torch.device(device)
    image = batch["image"].to(device, non_blocking=True)
    label = batch["label"].to(device, non_blocking=True)
    fields = (image, batch["box"], batch["extent"], batch["flip"], size)
    if randaug is None:
        return crop_resize_flip(*fields), label
    x = randaug(crop_pixels(*fields).round_().clamp_(0.0, 255.0), key)
    return x.sub_(127.5).div_(127.5).contiguous(), label
