"""RandAugment (Cubuk et al. 2020) as big_vision runs it (``pp/archive/autoaugment.py``), twice:
batched on whatever device the batch is on, and with Pillow per image for the per-item CPU path.

Each of ``layers`` rounds picks one of the 16 :data:`OPS` per image, uniformly, and applies it at the
shared ``magnitude``. Levels are divided by 10 (big_vision's ``_MAX_LEVEL``), so magnitudes above 10
extrapolate its level-to-argument table: rotate ``m/10·30``°, shear ``m/10·0.3``, translate
``m/10·100`` px, enhance factor ``m/10·1.8 + 0.1``, posterize ``int(m/10·4)`` bits, solarize
threshold ``int(m/10·256)``, solarize-add ``int(m/10·110)``, cutout half-side ``int(m/10·40)`` px;
rotations, shears and translations take a random sign; empty pixels are grey (128).

big_vision draws a probability from U(0.2, 0.8) for every op, but its RandAugment selects the op by
its index alone (``tf.cond(i == op_to_select, ...)``) and never reads that draw: the chosen op is
always applied. So it is here.

Where big_vision's TF code and Pillow disagree, both versions here follow Pillow, which the TF ops
name as their reference: Contrast blends towards the mean grey level (the TF op divides the pixel
count by 256 instead), Sharpness rounds its smoothed image, geometric ops sample pixel centres.
Differences by design:

- Translate and Cutout sizes scale with the image side, ``side/224`` (exactly big_vision's at 224,
  the resolution its recipes train at), so a 32 px image is not shifted or cut out entirely;
  translations are rounded to whole pixels.
- Posterize keeps at most 8 bits (identity): above magnitude 20 the table asks for more.
- Geometric ops on the device sample in float64; Pillow steps through the output in 16.16 fixed
  point, so a pixel whose source lies on a sampling boundary can come from its neighbour.

Every random choice of a device batch comes from a generator seeded by the run's seed and the
batch's place in the schedule (step, rank, micro-batch), as :mod:`training.mixup` does, so a resumed
run augments its next batch exactly as the uninterrupted run did. The per-item path draws from the
item's own generator, after its crop and flip.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageEnhance, ImageOps

#: big_vision's ``available_ops``, in its order (the op index a draw picks).
OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "Color", "Contrast",
       "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateX", "TranslateY", "Cutout", "SolarizeAdd")
MAX_LEVEL = 10.0
MAX_MAGNITUDE = 30
FILL = 128
#: The resolution big_vision's pixel constants (translate 100, cutout 40) are given at.
REFERENCE_SIDE = 224
# Kept apart from Mixup's stream, which is seeded by the same (seed, step, rank, micro-batch).
_STREAM = 0x5241


@dataclass(frozen=True)
class Choices:
    """Per image and layer: the op index into :data:`OPS`, the sign (±1) of a rotate, shear or
    translate, and the cutout centre as fractions of the height and width in [0, 1)."""

    op: np.ndarray
    sign: np.ndarray
    centre: np.ndarray

    def row(self, i: int) -> Choices:
        return Choices(self.op[i:i + 1], self.sign[i:i + 1], self.centre[i:i + 1])


def draw(n: int, layers: int, rng: np.random.Generator) -> Choices:
    return Choices(rng.integers(0, len(OPS), (n, layers)), np.where(rng.random((n, layers)) < 0.5, -1, 1),
                   rng.random((n, layers, 2)))


def level(name: str, magnitude: float, side: int = REFERENCE_SIDE) -> float:
    """big_vision's argument of op ``name`` at ``magnitude`` (before the random sign), for an image ``side`` px."""
    m = magnitude / MAX_LEVEL
    scale = side / REFERENCE_SIDE
    if name == "Rotate":
        return m * 30.0
    if name in ("ShearX", "ShearY"):
        return m * 0.3
    if name in ("TranslateX", "TranslateY"):
        return float(round(m * 100.0 * scale))
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        return m * 1.8 + 0.1
    if name == "Posterize":
        return min(8, int(m * 4))
    if name == "Solarize":
        return int(m * 256)
    if name == "SolarizeAdd":
        return int(m * 110)
    if name == "Cutout":
        return int(m * 40 * scale)
    return 0.0


@dataclass(frozen=True)
class RandAugment:
    """RandAugment(``layers``, ``magnitude``) with device batches keyed by ``seed`` and the batch's place."""

    layers: int
    magnitude: float
    seed: int = 0

    def choices(self, n: int, key: tuple[int, ...]) -> Choices:
        return draw(n, self.layers, np.random.default_rng([self.seed, *key, _STREAM]))

    def __call__(self, x: torch.Tensor, key: tuple[int, ...]) -> torch.Tensor:
        """Batch ``x`` (B, 3, H, W), whole-number pixel values 0..255 in float, augmented per image."""
        return apply_batch(x, self.choices(x.shape[0], key), self.magnitude)

    def pil(self, img: Image.Image, rng: np.random.Generator) -> Image.Image:
        """One RGB image augmented with choices drawn from the item's generator."""
        return apply_pil(img, draw(1, self.layers, rng), self.magnitude)


def from_config(randaug: list[int] | None, seed: int) -> RandAugment | None:
    """The config's ``randaug: [N, M]`` as a :class:`RandAugment`; None when it is off."""
    return None if randaug is None else RandAugment(int(randaug[0]), float(randaug[1]), seed)


# -- Pillow, per image --------------------------------------------------------------------------

def _lut(img: Image.Image, table) -> Image.Image:
    return img.point([min(255, max(0, int(v))) for v in table] * len(img.getbands()))


def _affine_pil(img: Image.Image, matrix: tuple[float, ...]) -> Image.Image:
    return img.transform(img.size, Image.AFFINE, matrix, resample=Image.NEAREST, fillcolor=(FILL,) * 3)


def pil_op(img: Image.Image, name: str, magnitude: float, sign: int = 1,
           centre: tuple[float, float] = (0.5, 0.5)) -> Image.Image:
    """Op ``name`` of :data:`OPS` on one RGB image, with Pillow."""
    arg = level(name, magnitude, min(img.size))
    if name == "AutoContrast":
        return ImageOps.autocontrast(img)
    if name == "Equalize":
        return ImageOps.equalize(img)
    if name == "Invert":
        return ImageOps.invert(img)
    if name == "Rotate":
        return img.rotate(sign * arg, resample=Image.NEAREST, fillcolor=(FILL,) * 3)
    if name == "Posterize":
        return ImageOps.posterize(img, arg)
    if name == "Solarize":
        return ImageOps.solarize(img, arg)
    if name == "SolarizeAdd":
        return _lut(img, [i + arg if i < 128 else i for i in range(256)])
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        return getattr(ImageEnhance, name)(img).enhance(arg)
    if name == "ShearX":
        return _affine_pil(img, (1.0, sign * arg, 0.0, 0.0, 1.0, 0.0))
    if name == "ShearY":
        return _affine_pil(img, (1.0, 0.0, 0.0, sign * arg, 1.0, 0.0))
    if name == "TranslateX":
        return _affine_pil(img, (1.0, 0.0, sign * arg, 0.0, 1.0, 0.0))
    if name == "TranslateY":
        return _affine_pil(img, (1.0, 0.0, 0.0, 0.0, 1.0, sign * arg))
    if name == "Cutout":
        y0, y1, x0, x1 = cutout_box(img.height, img.width, arg, centre)
        out = img.copy()
        if y1 > y0 and x1 > x0:
            out.paste((FILL,) * 3, (x0, y0, x1, y1))
        return out
    raise ValueError(f"unknown RandAugment op {name!r}; use one of {', '.join(OPS)}")


def apply_pil(img: Image.Image, choices: Choices, magnitude: float) -> Image.Image:
    """The layers of one image's ``choices`` (a one-row :class:`Choices`), in order."""
    for k in range(choices.op.shape[1]):
        img = pil_op(img, OPS[int(choices.op[0, k])], magnitude, int(choices.sign[0, k]),
                     tuple(choices.centre[0, k]))
    return img


def cutout_box(height: int, width: int, pad: int, centre: tuple[float, float]) -> tuple[int, int, int, int]:
    """big_vision's cutout: a (2·pad)² box centred at a uniformly drawn pixel, clipped: (y0, y1, x0, x1)."""
    cy, cx = int(centre[0] * height), int(centre[1] * width)
    return max(0, cy - pad), min(height, cy + pad), max(0, cx - pad), min(width, cx + pad)


# -- batched, on the batch's device --------------------------------------------------------------

def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: float) -> torch.Tensor:
    """Pillow's ``Image.blend`` in float32, truncated to whole values as its uint8 cast does."""
    f = torch.tensor(factor, dtype=torch.float32, device=x.device)
    return (degenerate + f * (x - degenerate)).clamp_(0.0, 255.0).floor_()


def _grey(x: torch.Tensor) -> torch.Tensor:
    """Pillow's RGB → L: ITU-R 601-2 luma in 16.16 fixed point, rounded; exact in float32 (every
    sum stays below 2**24). (B, 1, H, W)."""
    r, g, b = x.unbind(1)
    return (r * 19595.0 + g * 38470.0 + b * 7471.0 + 32768.0).div_(65536.0).floor_().unsqueeze(1)


def _apply_lut(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """Per-image, per-channel tables ``lut`` (B·C, 256) applied to ``x`` (B, C, H, W)."""
    b, c, h, w = x.shape
    flat = x.reshape(b * c, h * w).long()
    return lut.to(x.dtype).gather(1, flat).view(b, c, h, w)


def _autocontrast(x: torch.Tensor) -> torch.Tensor:
    """Pillow's table: ``int(i * scale + offset)`` in float64, clipped; identity where max <= min."""
    b, c = x.shape[:2]
    lo = x.amin(dim=(2, 3)).reshape(b * c, 1).double()
    hi = x.amax(dim=(2, 3)).reshape(b * c, 1).double()
    scale = 255.0 / (hi - lo).clamp(min=1.0)
    levels = torch.arange(256, device=x.device, dtype=torch.float64)[None]
    lut = torch.where(hi > lo, (levels * scale + (-lo * scale)).clamp(0.0, 255.0).floor(), levels)
    return _apply_lut(x, lut)


def _equalize(x: torch.Tensor) -> torch.Tensor:
    b, c, h, w = x.shape
    flat = x.reshape(b * c, h * w).long()
    rows = torch.arange(b * c, device=x.device)[:, None] * 256
    hist = torch.bincount((flat + rows).view(-1), minlength=b * c * 256).view(b * c, 256)
    last = hist.gather(1, flat.amax(1, keepdim=True))  # the count of the highest value present
    step = (h * w - last) // 255
    lut = (hist.cumsum(1) + step // 2) // step.clamp(min=1)
    lut = torch.cat([torch.zeros_like(lut[:, :1]), lut[:, :-1]], 1).clamp(max=255)
    levels = torch.arange(256, device=x.device)[None]
    return _apply_lut(x, torch.where(step > 0, lut, levels))


def _sharpness(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Pillow's SMOOTH filter (3x3, centre 5, sum 13; border pixels kept), rounded, then the blend."""
    kernel = torch.ones(3, 3, dtype=torch.float32, device=x.device)
    kernel[1, 1] = 5.0
    kernel = (kernel / 13.0).expand(x.shape[1], 1, 3, 3)
    smooth = torch.nn.functional.conv2d(x, kernel, groups=x.shape[1]).add_(0.5).floor_().clamp_(0.0, 255.0)
    degenerate = x.clone()
    degenerate[:, :, 1:-1, 1:-1] = smooth
    return _blend(degenerate, x, factor)


def _affine(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Nearest-neighbour resampling with per-image Pillow AFFINE coefficients (B, 6): the output
    pixel centre (x+½, y+½) reads input pixel ⌊a·x + b·y + c⌋, ⌊d·x + e·y + f⌋; outside is grey.

    The source pixel is chosen in float64 and ``grid_sample`` fetches its centre, so the fetch has
    half a pixel of slack; a ones channel marks what came from outside (big_vision's wrap/unwrap)."""
    b, c, h, w = x.shape
    m = matrix.to(x.device, torch.float64)[:, :, None, None]
    ys = (torch.arange(h, device=x.device, dtype=torch.float64) + 0.5)[None, :, None]
    xs = (torch.arange(w, device=x.device, dtype=torch.float64) + 0.5)[None, None, :]
    sx = (m[:, 0] * xs + m[:, 1] * ys + m[:, 2]).floor_().add_(0.5).mul_(2.0 / w).sub_(1.0)
    sy = (m[:, 3] * xs + m[:, 4] * ys + m[:, 5]).floor_().add_(0.5).mul_(2.0 / h).sub_(1.0)
    grid = torch.stack([sx, sy], dim=-1).to(x.dtype)
    wrapped = torch.cat([x, torch.ones_like(x[:, :1])], 1)
    out = torch.nn.functional.grid_sample(wrapped, grid, mode="nearest", padding_mode="zeros", align_corners=False)
    return torch.where(out[:, -1:] > 0, out[:, :-1], torch.full_like(out[:, :-1], FILL))


def rotate_matrix(degrees: float, width: int, height: int) -> tuple[float, ...]:
    """The AFFINE coefficients ``Image.rotate(degrees)`` uses: about the centre, counter-clockwise."""
    angle = -math.radians(degrees % 360.0)
    a, b = round(math.cos(angle), 15), round(math.sin(angle), 15)
    cx, cy = width / 2.0, height / 2.0
    return (a, b, a * -cx + b * -cy + cx, -b, a, -b * -cx + a * -cy + cy)


def _matrices(name: str, arg: float, signs: np.ndarray, width: int, height: int) -> torch.Tensor:
    rows = []
    for s in signs.tolist():
        v = s * arg
        rows.append({"Rotate": lambda: rotate_matrix(v, width, height),
                     "ShearX": lambda: (1.0, v, 0.0, 0.0, 1.0, 0.0), "ShearY": lambda: (1.0, 0.0, 0.0, v, 1.0, 0.0),
                     "TranslateX": lambda: (1.0, 0.0, v, 0.0, 1.0, 0.0),
                     "TranslateY": lambda: (1.0, 0.0, 0.0, 0.0, 1.0, v)}[name]())
    return torch.tensor(rows, dtype=torch.float64)


def _cutout(x: torch.Tensor, pad: int, centres: np.ndarray) -> torch.Tensor:
    out = x.clone()
    for i, centre in enumerate(centres.tolist()):
        y0, y1, x0, x1 = cutout_box(x.shape[2], x.shape[3], pad, centre)
        out[i, :, y0:y1, x0:x1] = FILL
    return out


def batch_op(x: torch.Tensor, name: str, magnitude: float, sign: np.ndarray | None = None,
             centre: np.ndarray | None = None) -> torch.Tensor:
    """Op ``name`` of :data:`OPS` on every image of ``x`` (B, 3, H, W; whole values 0..255 in float),
    with a sign (B,) and a cutout centre (B, 2) per image."""
    b, _, h, w = x.shape
    sign = np.ones(b, np.int64) if sign is None else np.asarray(sign)
    centre = np.full((b, 2), 0.5) if centre is None else np.asarray(centre)
    arg = level(name, magnitude, min(h, w))
    if name == "AutoContrast":
        return _autocontrast(x)
    if name == "Equalize":
        return _equalize(x)
    if name == "Invert":
        return 255.0 - x
    if name == "Posterize":
        q = float(2 ** (8 - arg))
        return (x / q).floor_().mul_(q)
    if name == "Solarize":
        return torch.where(x < arg, x, 255.0 - x)
    if name == "SolarizeAdd":
        return torch.where(x < 128, (x + arg).clamp_(0.0, 255.0), x)
    if name == "Color":
        return _blend(_grey(x).expand_as(x), x, arg)
    if name == "Contrast":
        mean = (_grey(x).double().mean(dim=(1, 2, 3), keepdim=True) + 0.5).floor().to(x.dtype)
        return _blend(mean.expand_as(x), x, arg)
    if name == "Brightness":
        return _blend(torch.zeros_like(x), x, arg)
    if name == "Sharpness":
        return _sharpness(x, arg)
    if name in ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY"):
        return _affine(x, _matrices(name, arg, sign, w, h))
    if name == "Cutout":
        return _cutout(x, arg, centre)
    raise ValueError(f"unknown RandAugment op {name!r}; use one of {', '.join(OPS)}")


def apply_batch(x: torch.Tensor, choices: Choices, magnitude: float) -> torch.Tensor:
    """Every layer of ``choices`` on ``x``: per layer, each op runs once on the images that drew it."""
    for k in range(choices.op.shape[1]):
        ops = choices.op[:, k]
        for o in np.unique(ops).tolist():
            rows = np.flatnonzero(ops == o)
            index = torch.from_numpy(rows).to(x.device)
            x = x.index_copy(0, index, batch_op(x.index_select(0, index), OPS[o], magnitude,
                                                choices.sign[rows, k], choices.centre[rows, k]))
    return x
