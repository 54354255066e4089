"""The transforms a near-duplicate detector must survive, both directions, as named, seeded functions.

Each transform maps an 8-bit RGB image to a new 8-bit RGB image the way a
copy of a test image typically reaches a web-scale corpus: rescaled, re-encoded,
cropped or framed, re-toned, desaturated. The calibration uses them to build
positives; the tests plant them in a corpus.

``REVERSE_TRANSFORMS`` go the other way, the way benchmark test sets were made
(CIFAR, Pets, ImageNet-val were cut from larger photos): the transformed image
is the *test* image, cut 2 to 10% per side from the corpus photo, resized to
256 px on its long side and re-encoded as JPEG at quality 30 to 90.
"""
from __future__ import annotations

import io
import random
from typing import Callable

from PIL import Image, ImageEnhance, ImageOps

Transform = Callable[[Image.Image, random.Random], Image.Image]


def _resize(scale: float) -> Transform:
    def f(img: Image.Image, rng: random.Random) -> Image.Image:
        w, h = img.size
        return img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.LANCZOS)
    return f


def _encode(fmt: str, **kw) -> Transform:
    def f(img: Image.Image, rng: random.Random) -> Image.Image:
        buf = io.BytesIO()
        src = img.convert("P", palette=Image.ADAPTIVE) if fmt == "GIF" else img
        src.save(buf, format=fmt, **kw)
        buf.seek(0)
        with Image.open(buf) as out:
            return out.convert("RGB")
    return f


def _crop(left: float, top: float, right: float, bottom: float) -> Transform:
    def f(img: Image.Image, rng: random.Random) -> Image.Image:
        w, h = img.size
        return img.crop((round(left * w), round(top * h), w - round(right * w), h - round(bottom * h)))
    return f


def _random_crop(img: Image.Image, rng: random.Random) -> Image.Image:
    return _crop(*(rng.uniform(0, 0.1) for _ in range(4)))(img, rng)


def _border(frac: float, color: tuple[int, int, int] | None) -> Transform:
    def f(img: Image.Image, rng: random.Random) -> Image.Image:
        w, h = img.size
        c = color if color is not None else tuple(rng.randrange(256) for _ in range(3))
        return ImageOps.expand(img, border=(round(frac * w), round(frac * h)), fill=c)
    return f


def _enhance(kind: str, factor: float) -> Transform:
    def f(img: Image.Image, rng: random.Random) -> Image.Image:
        return getattr(ImageEnhance, kind)(img).enhance(factor)
    return f


def _grayscale(img: Image.Image, rng: random.Random) -> Image.Image:
    return img.convert("L").convert("RGB")


def _chain(*fs: Transform) -> Transform:
    def f(img: Image.Image, rng: random.Random) -> Image.Image:
        for g in fs:
            img = g(img, rng)
        return img
    return f


TRANSFORMS: dict[str, Transform] = {
    "resize_0.25": _resize(0.25),
    "resize_0.5": _resize(0.5),
    "resize_2": _resize(2.0),
    "resize_4": _resize(4.0),
    "jpeg_q30": _encode("JPEG", quality=30),
    "jpeg_q50": _encode("JPEG", quality=50),
    "format_webp": _encode("WEBP", quality=80),
    "format_gif": _encode("GIF"),
    "crop_10_left": _crop(0.1, 0.0, 0.0, 0.0),
    "crop_10_top_left": _crop(0.1, 0.1, 0.0, 0.0),
    "crop_10_all": _crop(0.1, 0.1, 0.1, 0.1),
    "crop_random": _random_crop,
    "border_10_black": _border(0.1, (0, 0, 0)),
    "border_10_white": _border(0.1, (255, 255, 255)),
    "border_5_color": _border(0.05, None),
    "brightness_0.8": _enhance("Brightness", 0.8),
    "brightness_1.2": _enhance("Brightness", 1.2),
    "contrast_0.8": _enhance("Contrast", 0.8),
    "contrast_1.2": _enhance("Contrast", 1.2),
    "grayscale": _grayscale,
    "gray_jpeg_q30_half": _chain(_grayscale, _resize(0.5), _encode("JPEG", quality=30)),
}


# Transforms that draw from their seed: the calibration samples these several
# times per image, so one unlucky draw does not decide their recall.
def _one_side(rng: random.Random) -> tuple[float, ...]:
    box = [0.02] * 4
    box[rng.randrange(4)] = 0.1
    return tuple(box)


def _reverse(left: float | None = None, top: float = 0, right: float = 0, bottom: float = 0,
             quality: int | None = None, *, draw: Callable[[random.Random], tuple[float, ...]] | None = None
             ) -> Transform:
    """Cut a test image from a corpus photo: crop (``draw(rng)`` when given, else random 2..10% per
    side when ``left`` is None), long side to 256 px, JPEG at ``quality`` (random 30..90 when None)."""
    def f(img: Image.Image, rng: random.Random) -> Image.Image:
        if draw is not None:
            box = draw(rng)
        else:
            box = (left, top, right, bottom) if left is not None else tuple(rng.uniform(0.02, 0.1) for _ in range(4))
        img = _crop(*box)(img, rng)
        scale = 256 / max(img.size)
        img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.LANCZOS)
        return _encode("JPEG", quality=quality if quality is not None else rng.randint(30, 90))(img, rng)
    return f


REVERSE: dict[str, Transform] = {
    "reverse_crop_2_all_q75": _reverse(0.02, 0.02, 0.02, 0.02, 75),
    "reverse_crop_5_all_q50": _reverse(0.05, 0.05, 0.05, 0.05, 50),
    "reverse_crop_10_all_q30": _reverse(0.1, 0.1, 0.1, 0.1, 30),
    # 10% from one side and 2% from the others, once per side (a code aimed at the
    # left side alone would pass a left-only calibration)
    "reverse_crop_10_left_q90": _reverse(0.1, 0.02, 0.02, 0.02, 90),
    "reverse_crop_10_right_q90": _reverse(0.02, 0.02, 0.1, 0.02, 90),
    "reverse_crop_10_top_q90": _reverse(0.02, 0.1, 0.02, 0.02, 90),
    "reverse_crop_10_bottom_q90": _reverse(0.02, 0.02, 0.02, 0.1, 90),
    "reverse_crop_random": _reverse(),
    "reverse_crop_10_side_random": _reverse(draw=_one_side),  # the side and the quality drawn
}
TRANSFORMS.update(REVERSE)
REVERSE_TRANSFORMS = frozenset(REVERSE)
RANDOM_TRANSFORMS = frozenset({"crop_random", "border_5_color", "reverse_crop_random",
                               "reverse_crop_10_side_random"})


def apply(name: str, img: Image.Image, seed: int = 0) -> Image.Image:
    if name not in TRANSFORMS:
        raise KeyError(f"transform {name!r}: unknown; choose from {', '.join(TRANSFORMS)}")
    return TRANSFORMS[name](img.convert("RGB"), random.Random(seed))
