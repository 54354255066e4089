"""Near-duplicate signatures and exact content hashes of decoded images.

The paper (Section 4.1) de-duplicates pre-training data against downstream test
sets following BiT (Kolesnikov et al. 2020, Appendix C), whose detector is not
published. This module is ours: a perceptual code over *luminance only*, so a
grayscale copy of a colour image has the same signature (Pillow's ``L`` is the
same ITU-R 601-2 weighting that produced the grayscale copy).

A signature is ``SIGNATURE_BYTES`` bytes: ``CODE_BITS`` sign bits of the lowest
2-D DCT frequencies of the border-trimmed luminance, area-averaged to
``DCT_SIZE``x``DCT_SIZE`` (so 0.25x..4x resizes and JPEG re-encoding barely move
it). Every code of an image is cut from one small luminance :func:`proxy`, made once. Each bit says whether a coefficient lies above the
median of the selected coefficients, which is invariant to any brightness and
positive contrast change that does not clip. Uniform borders are trimmed first,
so an added frame maps back to the original content. Crops are handled on the
index side (:func:`variant_codes`): each test image is also indexed under the
crops a corpus copy may have had (``CROP_VARIANTS``), and a corpus image
matches when it is close to any of them (the match rule: :mod:`neardup.index`).
For the reverse direction, a test image cut from a corpus photo, the corpus
side also stores the codes of inner crops (:func:`corpus_codes`, ``INNER_CROPS``).

The threshold is ``neardup.index.DEFAULT_THRESHOLD``, chosen by :mod:`dedup.calibration`;
the measured recall and false-match rate are in benchmarks/README.md, and why the
rule is built this way in docs/dedup.md, "How the rule was chosen".
"""
from __future__ import annotations

import functools
import hashlib
import math
from typing import NamedTuple

import numpy as np
import pyarrow as pa
from PIL import Image
from scipy.fft import dct

SIGNATURE_VERSION = 7
DCT_SIZE = 32
CODE_BITS = 128
SIGNATURE_BYTES = CODE_BITS // 8
WORDS = CODE_BITS // 64

# Coefficients ordered by total frequency u+v, then u, DC excluded: the lowest
# frequencies survive resizing, re-encoding and small shifts best.
_ORDER = sorted(((u, v) for u in range(DCT_SIZE) for v in range(DCT_SIZE) if (u, v) != (0, 0)),
                key=lambda uv: (uv[0] + uv[1], uv[0]))[:CODE_BITS]
_ROWS = np.array([u for u, _ in _ORDER])
_COLS = np.array([v for _, v in _ORDER])
_FREQS = int(max(_ROWS.max(), _COLS.max())) + 1
# The orthonormal DCT-II rows up to the highest frequency a code keeps.
_DCT = dct(np.eye(DCT_SIZE), norm="ortho", axis=0)[:_FREQS]
_GRID = np.linspace(0.0, 1.0, DCT_SIZE + 1)
# The transform runs on whole numbers, so that it gives the same coefficients on every CPU:
# OpenBLAS picks its matmul kernel per CPU (AVX-512, AVX2, SSE), and each kernel rounds a float
# sum in its own order, which moved the bits of near-ties and every texture margin. Products and
# sums of whole numbers below 2**53 are exact in float64, in any order. _DCT_SCALE sets the
# rows' precision (2**-20, far below any bit's distance from the median).
_DCT_SCALE = 2.0 ** 20
# The same rows applied to the DCT_SIZE + 1 cell corners of a summed-area table: a cell
# is the difference of its corners, so _DCT @ cells == _DCT_OF_CORNERS @ corners (the
# differences of whole numbers, so each row still sums to exactly 0).
_DCT_OF_CORNERS = -np.diff(np.rint(_DCT * _DCT_SCALE), prepend=0, append=0, axis=1)
# An operand below 2**_OPERAND_BITS keeps every partial sum of a row's products below 2**53.
_OPERAND_BITS = 53 - math.frexp(float(np.abs(_DCT_OF_CORNERS).sum(axis=1).max()))[1]

# Every code of an image is cut from one luminance proxy (:func:`proxy`): the
# image reduced by an integer factor to a long side of PROXY_SIDE..2*PROXY_SIDE-1
# pixels, once. A code then costs tens of microseconds whatever the image size
# (resampling the full image per code cost 0.4 ms a code). 96 rather than
# 128 (version 5) saves about 0.07 ms an image at held-out recall 0.996 against 0.997; 64
# lost recall and added false pairs (docs/dedup.md, "How the rule was chosen").
PROXY_SIDE = 96

# Border trimming works on the proxy; a row or column is border when it is
# flat and has the colour of the edge it touches. Tolerances absorb JPEG ringing.
_TRIM_STD = 2.5
_TRIM_MEAN = 6.0
_TRIM_MAX = 0.25
# Index-side crop variants (left, top, right, bottom) as fractions of each side.
# A corpus copy cropped by up to 10% per side, each side independently, lies in
# the box [0, 0.1]^4 of crops. The code tolerates about 2.5% of misalignment per
# side, so the 16 centres (0.025 | 0.075)^4 cover that box's interior in the
# L-infinity sense; the uncrop, the 10% side crops and the six 10% two-side
# crops are kept exactly because those are the common crops (and the centres
# reach them only at their covering radius). Held-out calibration
# (dedup.calibration): the 16 centres raised random-crop recall under the match
# rule from 0.79 (9 variants) to 0.97; the full {0, 0.05, 0.1}^4 grid (81
# variants) reached 0.99 but more than doubled the distinct-pair false matches
# and triples the index. The 10% three-side crops, also tried, added a held-out
# false pair; the four two-side crops added here (29 variants) did not and
# took random crops from 0.974 to 0.984.
_CROP_CORNERS: tuple[tuple[float, float, float, float], ...] = (
    (0.0, 0.0, 0.0, 0.0),
    (0.1, 0.0, 0.0, 0.0), (0.0, 0.1, 0.0, 0.0), (0.0, 0.0, 0.1, 0.0), (0.0, 0.0, 0.0, 0.1),
    (0.1, 0.1, 0.0, 0.0), (0.0, 0.0, 0.1, 0.1), (0.1, 0.0, 0.0, 0.1), (0.0, 0.1, 0.1, 0.0),
    (0.1, 0.0, 0.1, 0.0), (0.0, 0.1, 0.0, 0.1),
    (0.05, 0.05, 0.05, 0.05), (0.1, 0.1, 0.1, 0.1),
)
_CROP_CENTRES = tuple((l, t, r, b) for l in (0.025, 0.075) for t in (0.025, 0.075)
                      for r in (0.025, 0.075) for b in (0.025, 0.075))
CROP_VARIANTS: tuple[tuple[float, float, float, float], ...] = _CROP_CORNERS + _CROP_CENTRES

# Corpus-side inner crops (left, top, right, bottom fractions of the trimmed
# image), for the reverse direction: a test image T cut from a corpus photo C
# by b <= 10% per side. C's 10%-per-side centre is then T cropped by
# (0.1 - b_side) / (1 - b_l - b_r) per side, 0 to 0.111, which is the box the
# index-side CROP_VARIANTS of T already cover; the 12% centre moves that point
# 2.5% inwards, towards the variant centres. A cut of 10% on one side and little
# elsewhere is reached by neither at a threshold with no false pair, so one
# code per side aims at it: 12% off that side, 6% off the other three (all four
# sides, since a test set is cut from any side). Where INNER_TRIM is set, the
# inner crop is trimmed again before coding: T's own uniform edge (a mortar
# line, a dark sky band) is trimmed when T is coded, and the centre of C then
# has it at its edge. These codes are matched at a tighter threshold than the
# whole-image code (neardup.index.INNER_THRESHOLD_OFFSET). Held-out calibration
# of versions 4 and 5: docs/dedup.md, "How the rule was chosen".
# Low-texture images (flat colour, soft gradients) are exact-or-nothing: below
# this texture_margin neither side carries codes, so they match by content hash
# only. The threshold sits in the gap the calibration measured between real
# photographs and such images (dedup.calibration.low_texture_report).
LOW_TEXTURE_MARGIN = 2.5

INNER_CROPS: tuple[tuple[float, float, float, float], ...] = (
    (0.1, 0.1, 0.1, 0.1), (0.12, 0.12, 0.12, 0.12),
    (0.12, 0.06, 0.06, 0.06), (0.06, 0.12, 0.06, 0.06), (0.06, 0.06, 0.12, 0.06), (0.06, 0.06, 0.06, 0.12),
)
INNER_TRIM: tuple[bool, ...] = (True, False, False, False, False, False)
CORPUS_CODES = 1 + len(INNER_CROPS)
CORPUS_SIGNATURE_BYTES = CORPUS_CODES * SIGNATURE_BYTES


def content_hash(img: Image.Image) -> str:
    """sha256 hex of the decoded pixels, mode and size: identical pixels <=> identical hash."""
    digest = hashlib.sha256(f"{img.mode}:{img.width}x{img.height}:".encode())
    digest.update(img.tobytes())
    return digest.hexdigest()


def _luminance_image(img: Image.Image) -> Image.Image:
    """Pillow's ``L`` luminance of any decoded image (a grayscale copy of an RGB image has the same)."""
    if img.mode not in ("L", "RGB"):
        img = img.convert("RGB")
    return img if img.mode == "L" else img.convert("L")


def luminance(img: Image.Image) -> np.ndarray:
    """float32 luminance in 0..255 of any decoded image (RGB, L, RGBA, P...)."""
    return np.asarray(_luminance_image(img), dtype=np.float32)


class Proxy(NamedTuple):
    """The luminance of an image reduced once, from which all its codes are cut.

    ``lum`` (h, w) uint8 grey levels. Proxy pixel (i, j) covers image rows
    ``offset[1] + i * scale`` .. ``+ scale`` and as many columns from ``offset[0] + j * scale``;
    it is the mean of those columns along one image row, the band's first, where
    ``scale >= ROW_SAMPLED_SCALE``, and the mean of the whole square below that.
    The image's remainder rows and columns (fewer than ``scale``) are split between its
    two edges. ``sat`` is its (h + 1, w + 1) summed-area table (float64, exact).
    """

    lum: np.ndarray
    sat: np.ndarray
    scale: int
    offset: tuple[int, int]


# From this reduction factor up, a proxy row is one image row (the middle of its band) averaged
# along the row, not a square mean: reading every row of a decoded image is the cost of the
# signatures (two full Pillow passes took 0.35 ms of 0.68 ms an image), and a code
# cell still averages several rows. Below it the image is small and read whole.
ROW_SAMPLED_SCALE = 4


def _rgbx_rows(img: Image.Image, y0: int, step: int, rows: int) -> Image.Image | None:
    """Rows ``y0``, ``y0 + step``, ... of an RGB image as an ``RGBX`` image over its own memory, or None.

    Pillow exports an RGB image's 4-byte pixels through the Arrow C data interface without
    a copy (the same route as ``pipelines.decode.rgbx_view``); mapping them with a row
    stride reads only the sampled rows. None where Pillow holds the image in several blocks.
    """
    try:
        buf = pa.array(img).values.buffers()[1]
    except (ValueError, TypeError, pa.ArrowException):
        return None
    line = img.width * 4
    if buf is None or buf.size < img.width * img.height * 4:
        return None
    return Image.frombuffer("RGBX", (img.width, rows), buf.slice(y0 * line, rows * step * line), "raw", "RGBX",
                            step * line, 1)


def _sampled_rows(img: Image.Image, y0: int, step: int, rows: int) -> Image.Image:
    """Luminance (mode L) of rows ``y0``, ``y0 + step``, ... of a decoded RGB or L image."""
    if img.mode == "RGB":
        view = _rgbx_rows(img, y0, step, rows)
        if view is not None:
            return view.convert("L")
        img = img.convert("L")  # several memory blocks: a large image, read whole
    return Image.fromarray(np.ascontiguousarray(np.asarray(img)[y0: y0 + rows * step: step]))


def proxy(img: Image.Image | np.ndarray) -> Proxy:
    """The :class:`Proxy` of a decoded image, or of a :func:`luminance` array."""
    if isinstance(img, np.ndarray):
        img = Image.fromarray(np.asarray(img, dtype=np.uint8))
    elif img.mode not in ("L", "RGB"):
        img = img.convert("RGB")
    f = max(1, min(max(img.size) // PROXY_SIDE, min(img.size)))  # a thin strip keeps one row
    w, h = img.width // f * f, img.height // f * f
    ox, oy = (img.width - w) // 2, (img.height - h) // 2
    if f >= ROW_SAMPLED_SCALE:
        rows = _sampled_rows(img, oy, f, h // f)
        lum = rows.reduce((f, 1), box=(ox, 0, ox + w, rows.height))
    else:
        lum = _luminance_image(img)
        if f > 1:
            lum = lum.reduce(f, box=(ox, oy, ox + w, oy + h))
    pixels = np.asarray(lum)
    return Proxy(pixels, _summed_area(pixels), f, (ox, oy))


def _summed_area(pixels: np.ndarray) -> np.ndarray:
    """(h + 1, w + 1) float64 summed-area table of (h, w) uint8 ``pixels``, zero first row and column.

    Summed in int32 (exact: at most 255 * 255**2), so the order of the additions does not matter.
    numpy accumulates down the columns of a C array three times slower than along its rows, so
    the column sums run along the rows of the transposed row sums. The table is float64: it holds
    these sums exactly, and numpy gathers and interpolates it twice as fast as int32.
    """
    h, w = pixels.shape
    sums = np.cumsum(pixels, axis=1, dtype=np.int32).T.copy()
    np.cumsum(sums, axis=1, out=sums)
    sat = np.zeros((h + 1, w + 1))
    sat[1:, 1:] = sums.T
    return sat


def _trim(lum: np.ndarray, mixed_rows: bool = False, mixed_cols: bool = False) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the content of ``lum`` inside uniform borders, in its pixels.

    ``mixed_rows`` / ``mixed_cols``: ``lum`` is a reduced proxy whose first row / column past
    a border mixes border and content (:func:`_mixed`); it is trimmed too, since a strip of
    border colour moves the code far more than losing under one proxy pixel of content does.
    """
    ph, pw = lum.shape

    def run(lines: np.ndarray, limit: int, mixed: bool) -> int:
        if limit <= 0:
            return 0
        lines = lines[:limit]
        first = lines[0]
        if np.dot(first, first) / len(first) - (first.sum() / len(first)) ** 2 > _TRIM_STD ** 2:
            return 0
        mean = lines.mean(axis=1)
        flat = (lines.std(axis=1) <= _TRIM_STD) & (np.abs(mean - mean[0]) <= _TRIM_MEAN)
        if flat.all():
            return len(lines)
        return int(np.argmin(flat)) + mixed

    if ph >= 8 and pw >= 8 and _edges_vary(lum):
        return (0, 0, pw, ph)  # most images: no edge is flat, which run() would find side by side
    lum = lum.astype(np.float64)  # run() squares and sums grey levels; only images with a flat edge get here
    # Repeat so a frame added around an image whose own margin is flat peels down
    # to the same content as the original: frame first, then the natural margin.
    left = top = 0
    right, bottom = pw, ph
    for _ in range(4):
        cur = lum[top:bottom, left:right]
        ch, cw = cur.shape
        if ch < 8 or cw < 8:
            break
        t = run(cur, int(ph * _TRIM_MAX) - top, mixed_rows)
        b = run(cur[::-1], int(ph * _TRIM_MAX) - (ph - bottom), mixed_rows)
        l = run(cur.T, int(pw * _TRIM_MAX) - left, mixed_cols)
        r = run(cur.T[::-1], int(pw * _TRIM_MAX) - (pw - right), mixed_cols)
        if not (t or b or l or r):
            break
        top, bottom, left, right = top + t, bottom - b, left + l, right - r
    if right - left < 8 or bottom - top < 8:
        return (0, 0, pw, ph)
    return (left, top, right, bottom)


def _edges_vary(lum: np.ndarray) -> bool:
    """Whether each of the four edge lines of ``lum`` varies more than a flat border (``run`` in :func:`_trim`).

    Summed for all four lines at once: ``lum`` holds whole grey levels, so the sums are exact
    and equal to ``run``'s line by line, and the variances come out bit for bit the same.
    """
    ph, pw = lum.shape
    lines = np.concatenate((lum[0], lum[-1], lum[:, 0], lum[:, -1]), dtype=np.float64)
    starts = (0, pw, 2 * pw, 2 * pw + ph)
    sums, squares = np.add.reduceat(lines, starts), np.add.reduceat(lines * lines, starts)
    return all(sq / n - (s / n) ** 2 > _TRIM_STD ** 2 for sq, s, n in zip(squares, sums, (pw, pw, ph, ph)))


def _mixed(p: Proxy) -> tuple[bool, bool]:
    """Whether a proxy row / column mixes image lines: a row-sampled proxy row is one image row."""
    return 1 < p.scale < ROW_SAMPLED_SCALE, p.scale > 1


def _trim_region(p: Proxy, box: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
    """``box`` (proxy pixels, fractional) trimmed of uniform borders as if it were cropped out first.

    The trim reads whole proxy pixels; a side that loses nothing keeps its fractional edge.
    """
    x0, y0, x1, y1 = (int(round(v)) for v in box)
    l, t, r, b = _trim(p.lum[y0:y1, x0:x1], *_mixed(p))
    return (box[0] if l == 0 else x0 + l, box[1] if t == 0 else y0 + t,
            box[2] if r == x1 - x0 else x0 + r, box[3] if b == y1 - y0 else y0 + b)


def trim_box(lum: np.ndarray | Image.Image) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the content inside uniform borders, in pixels of ``lum``.

    ``lum`` is a decoded image or what :func:`luminance` returns; the trim is read on its proxy.
    """
    p = proxy(lum)
    h, w = (lum.height, lum.width) if isinstance(lum, Image.Image) else lum.shape
    l, t, r, b = _trim(p.lum, *_mixed(p))
    (ox, oy), f = p.offset, p.scale
    return (0 if l == 0 else ox + l * f, 0 if t == 0 else oy + t * f,
            w if r == p.lum.shape[1] else ox + r * f, h if b == p.lum.shape[0] else oy + b * f)


def _inset(box: tuple[float, float, float, float], frac: tuple[float, float, float, float]
           ) -> tuple[float, float, float, float]:
    """``box`` cropped by ``frac`` = (left, top, right, bottom) fractions of its width and height."""
    x0, y0, x1, y1 = box
    w, h = x1 - x0, y1 - y0
    return (x0 + frac[0] * w, y0 + frac[1] * h, x1 - frac[2] * w, y1 - frac[3] * h)


def _coeffs(p: Proxy, boxes) -> np.ndarray:
    """(k, CODE_BITS) DCT coefficients of the ``boxes`` (proxy pixels, fractional) of ``p``.

    Each box is area-averaged to DCT_SIZE x DCT_SIZE cells (a box filter, exact for
    fractional edges: the summed-area table is bilinear between its knots), then
    transformed. Cell sums stand in for cell means: a positive scale moves no bit. The
    cells are differences of the table at their corners, folded into the transform
    (``_DCT_OF_CORNERS``): the ingest pays for every numpy pass here, within a 5% share of its item time.
    """
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    size, last = _table_layout(*p.sat.shape)
    lo = boxes[:, :2, None]
    edges = np.minimum(np.maximum(lo + (boxes[:, 2:, None] - lo) * _GRID, 0), size)  # (k, 2: x, y, 33)
    knot = np.minimum(edges.astype(np.intp), last)
    frac = edges - knot
    fx, fy = frac[:, None, 0, :], frac[:, 1, :, None]
    at = (knot[:, 1] * p.sat.shape[1])[:, :, None] + knot[:, None, 0]
    # the table at each corner's knot and its right, lower and lower-right neighbours: one gather
    # each from the table shifted by that neighbour's offset, and the interpolation in place
    # (one stacked index and gather, and fresh arrays, took about 10 us more an image)
    flat, cols = p.sat.ravel(), p.sat.shape[1]
    knot_value, below = flat.take(at), flat[cols:].take(at)
    top = flat[1:].take(at)
    top -= knot_value
    top *= fx
    top += knot_value
    corners = flat[cols + 1:].take(at)
    corners -= below
    corners *= fx
    corners += below
    corners -= top
    corners *= fy
    corners += top  # the table at the cell corners, (k, 33, 33)
    # As whole numbers below 2**_OPERAND_BITS: the table's last value is its largest, and one bit
    # is left for the interpolation's rounding. The scale is the proxy's, not the box's, so a
    # box's code does not depend on the other boxes computed with it.
    scale = math.ldexp(1.0, _OPERAND_BITS - 1 - math.frexp(p.sat[-1, -1])[1])
    corners *= scale  # a power of two: exact
    rows, row_scale = _whole_numbers(_DCT_OF_CORNERS @ np.rint(corners, out=corners))
    coeffs = (rows @ _DCT_OF_CORNERS.T)[:, _ROWS, _COLS]
    coeffs /= row_scale[:, :, 0] * (scale * _DCT_SCALE ** 2)  # powers of two: exact
    return coeffs


def _whole_numbers(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(k, m, n) ``values`` as whole numbers of magnitude at most 2**_OPERAND_BITS, and the scales, (k, 1, 1).

    Each box is scaled by a power of two of its own (exact, and cheaper than ``np.ldexp``), then
    rounded to whole numbers.
    """
    _, exponent = np.frexp(np.abs(values).max(axis=(1, 2), keepdims=True))
    scale = np.ldexp(1.0, _OPERAND_BITS - exponent)
    whole = values * scale
    return np.rint(whole, out=whole), scale


@functools.lru_cache(maxsize=64)
def _table_layout(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """A summed-area table's extent and last knot, (x, y), shaped for :func:`_coeffs`; made once per
    proxy shape, since making such small arrays from lists costs more than the arithmetic on them."""
    size = np.array([[cols - 1], [rows - 1]], dtype=np.float64)
    last = np.array([[cols - 2], [rows - 2]], dtype=np.intp)
    size.flags.writeable = last.flags.writeable = False
    return size, last


_MID = CODE_BITS // 2  # the median of CODE_BITS values is the mean of the two at _MID - 1 and _MID in order


def _median(values: np.ndarray) -> np.ndarray:
    """Median of each row of (k, CODE_BITS) values, as (k, 1); np.median costs ten times a sort here."""
    ordered = np.sort(values, axis=-1)
    return (ordered[..., _MID - 1: _MID] + ordered[..., _MID: _MID + 1]) / 2


def _bits(coeffs: np.ndarray) -> np.ndarray:
    """(k, SIGNATURE_BYTES) uint8: per row of (k, CODE_BITS) ``coeffs``, which lie above the row's median."""
    return np.packbits(coeffs > _median(coeffs)).reshape(-1, SIGNATURE_BYTES)  # a row is whole bytes


def _margin(coeffs: np.ndarray) -> float:
    """Median distance of (CODE_BITS,) ``coeffs`` from their median (:func:`texture_margin`).

    On numpy scalars, the same operations as :func:`_median` on arrays, in about half the time.
    """
    ordered = np.sort(coeffs)
    ordered = np.sort(np.abs(coeffs - (ordered[_MID - 1] + ordered[_MID]) / 2))
    return float((ordered[_MID - 1] + ordered[_MID]) / 2)


def texture_margin(img: Image.Image) -> float:
    """Median distance of the code's DCT coefficients from their median (grey levels x 32).

    Each code bit says on which side of that median a coefficient lies, so this
    is how far a typical bit is from flipping. Flat colour and soft gradients
    have it near 0 (their bits are JPEG noise, or the same for every gradient of
    one direction); below ``LOW_TEXTURE_MARGIN`` an image is matched by its
    content hash only.
    """
    p = proxy(img)
    box = _trim(p.lum, *_mixed(p))
    return _margin(_coeffs(p, box)[0] / _cell_area(p, box))


def _cell_area(p: Proxy, box) -> float:
    """Proxy pixels per code cell of ``box``: turns the cell sums of :func:`_coeffs` into grey levels."""
    return (box[2] - box[0]) * (box[3] - box[1]) / DCT_SIZE ** 2


def compute(img: Image.Image) -> bytes:
    """The near-duplicate signature of a decoded image: ``SIGNATURE_BYTES`` bytes (its trimmed whole-image code)."""
    p = proxy(img)
    return _bits(_coeffs(p, _trim(p.lum, *_mixed(p))))[0].tobytes()


def _corpus_boxes(p: Proxy) -> list[tuple[float, float, float, float]]:
    """The boxes of :func:`corpus_codes`: the trimmed image, then each ``INNER_CROPS`` entry of it."""
    whole = tuple(float(v) for v in _trim(p.lum, *_mixed(p)))
    boxes = [whole]
    for frac, trim in zip(INNER_CROPS, INNER_TRIM):
        box = _inset(whole, frac)
        boxes.append(_trim_region(p, box) if trim else box)
    return boxes


def corpus_codes(img: Image.Image) -> bytes:
    """What the corpus side stores and searches: ``CORPUS_SIGNATURE_BYTES`` bytes, or b"" for low texture.

    The first ``SIGNATURE_BYTES`` are :func:`compute` (the forward direction: a
    corpus copy that is a crop of a test image); then one code per
    ``INNER_CROPS`` entry (the reverse direction: a test image that is a crop of
    the corpus image), all cut from one :func:`proxy`.
    """
    p = proxy(img)
    boxes = _corpus_boxes(p)
    coeffs = _coeffs(p, boxes)
    if _margin(coeffs[0] / _cell_area(p, boxes[0])) < LOW_TEXTURE_MARGIN:
        return b""  # low texture: exact (content hash) matches only
    return _bits(coeffs).tobytes()


def corpus_codes_any_texture(img: Image.Image) -> np.ndarray:
    """(CORPUS_CODES, SIGNATURE_BYTES) codes of :func:`corpus_codes` without the low-texture rule, to measure it."""
    p = proxy(img)
    return _bits(_coeffs(p, _corpus_boxes(p)))


def _variant_boxes(p: Proxy) -> tuple[list, list]:
    """(crops of the trimmed image, the same crops of the untrimmed image trimmed after cropping)."""
    h, w = p.lum.shape
    whole = tuple(float(v) for v in _trim(p.lum, *_mixed(p)))
    trimmed = [_inset(whole, frac) for frac in CROP_VARIANTS]
    raw = [_trim_region(p, _inset((0.0, 0.0, float(w), float(h)), frac)) for frac in CROP_VARIANTS]
    return trimmed, raw


def variant_codes(img: Image.Image, *, any_texture: bool = False) -> np.ndarray:
    """Signatures of the test image under its crop variants: (variants, SIGNATURE_BYTES) uint8.

    Row ``k < len(CROP_VARIANTS)`` is ``CROP_VARIANTS[k]`` of the trimmed image
    (row 0 is :func:`compute`); the rows after them, at most
    ``len(CROP_VARIANTS)`` and only where they differ, are the same crops taken
    before trimming and then trimmed, as :func:`compute` sees a cropped copy.
    No rows for a low-texture image (``LOW_TEXTURE_MARGIN``) unless ``any_texture``.
    """
    p = proxy(img)
    trimmed, raw = _variant_boxes(p)
    coeffs = _coeffs(p, trimmed + raw)
    if not any_texture and _margin(coeffs[0] / _cell_area(p, trimmed[0])) < LOW_TEXTURE_MARGIN:
        return np.zeros((0, SIGNATURE_BYTES), dtype=np.uint8)  # low texture: exact matches only
    codes = _bits(coeffs)
    # A crop can bring a flat part of the content (sky, a wall) onto the new
    # edge, and the query side then trims it away (up to _TRIM_MAX of a side):
    # no crop of the trimmed image looks like that. Indexing trim(crop(image))
    # too covers it exactly, since the trimmed edge stops where the content
    # starts whatever the crop; for images without flat regions these codes
    # equal the first ones and are dropped (its effect on recall: benchmarks/README.md).
    n = len(CROP_VARIANTS)
    seen = {c.tobytes() for c in codes[:n]}
    keep = list(range(n))
    for k in range(n, len(codes)):
        if codes[k].tobytes() not in seen:
            seen.add(codes[k].tobytes())
            keep.append(k)
    return codes[keep]


def split_codes(stored: bytes) -> list[bytes]:
    """The codes of a stored corpus signature (:func:`corpus_codes`, or a bare :func:`compute`)."""
    if stored is None or len(stored) % SIGNATURE_BYTES:
        raise ValueError(f"corpus signature of {len(stored or b'')} bytes: expected a multiple of {SIGNATURE_BYTES}; "
                         f"recompute it with neardup.signatures.corpus_codes (signature version {SIGNATURE_VERSION})")
    return [stored[i: i + SIGNATURE_BYTES] for i in range(0, len(stored), SIGNATURE_BYTES)]


def to_words(signatures: np.ndarray | bytes | list[bytes]) -> np.ndarray:
    """Signatures as (n, WORDS) uint64, the layout the index searches."""
    if isinstance(signatures, (bytes, bytearray)):
        signatures = [bytes(signatures)]
    if isinstance(signatures, list):
        bad = [i for i, s in enumerate(signatures) if len(s) != SIGNATURE_BYTES]
        if bad:
            raise ValueError(
                f"signature #{bad[0]} has {len(signatures[bad[0]])} bytes, expected {SIGNATURE_BYTES}; "
                "recompute it with neardup.signatures.compute (signature version "
                f"{SIGNATURE_VERSION})")
        signatures = np.frombuffer(b"".join(signatures), dtype=np.uint8).reshape(-1, SIGNATURE_BYTES)
    arr = np.ascontiguousarray(signatures, dtype=np.uint8).reshape(-1, SIGNATURE_BYTES)
    return arr.view(">u8").astype(np.uint64)


def hamming(a: bytes, b: bytes) -> int:
    """Hamming distance between two signatures."""
    return int(np.bitwise_count(to_words(a) ^ to_words(b)).sum())
