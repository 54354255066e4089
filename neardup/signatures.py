"""Near-duplicate signatures and exact content hashes of decoded images.

The paper (Section 4.1) de-duplicates pre-training data against downstream test
sets following BiT (Kolesnikov et al. 2020, Appendix C), whose detector is not
published. This module is ours: a perceptual code over *luminance only*, so a
grayscale copy of a colour image has the same signature (Pillow's ``L`` is the
same ITU-R 601-2 weighting that produced the grayscale copy).

A signature is ``SIGNATURE_BYTES`` bytes: ``CODE_BITS`` sign bits of the lowest
2-D DCT frequencies of the border-trimmed luminance, resampled to
``DCT_SIZE``x``DCT_SIZE`` with area averaging (so 0.25x..4x resizes and JPEG
re-encoding barely move it). Each bit says whether a coefficient lies above the
median of the selected coefficients, which is invariant to any brightness and
positive contrast change that does not clip. Uniform borders are trimmed first,
so an added frame maps back to the original content. Crops are handled on the
index side (:func:`variant_codes`): each test image is also indexed under the
crops a corpus copy may have had (``CROP_VARIANTS``), and a corpus image
matches when it is close to any of them (the match rule: :mod:`neardup.index`).
For the reverse direction, a test image cut from a corpus photo, the corpus
side also stores the codes of inner crops (:func:`corpus_codes`, ``INNER_CROPS``).

The threshold is ``neardup.index.DEFAULT_THRESHOLD``, chosen by :mod:`dedup.calibration`;
the measured recall and false-match rate are in benchmarks/README.md.
"""
from __future__ import annotations

import hashlib

import numpy as np
from PIL import Image
from scipy.fft import dctn

SIGNATURE_VERSION = 4
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

# Border trimming works on a small proxy; a row or column is border when it is
# flat and has the colour of the edge it touches. Tolerances absorb JPEG ringing.
_TRIM_PROXY = 256
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
# 2.5% inwards, towards the variant centres, which is what a crop of 10% on one
# side and little elsewhere needs. Where INNER_TRIM is set, the inner crop is
# trimmed again before coding: T's own uniform edge (a mortar line, a dark sky
# band) is trimmed when T is coded, and the centre of C then has it at its edge.
# These codes are matched at a tighter threshold than the whole-image code
# (neardup.index.INNER_THRESHOLD_OFFSET). Held-out calibration, signature version 4
# against 3: benchmarks/README.md, "Reverse direction".
# Low-texture images (flat colour, soft gradients) are exact-or-nothing: below
# this texture_margin neither side carries codes, so they match by content hash
# only. The threshold sits in the gap the calibration measured between real
# photographs and such images (dedup.calibration.low_texture_report).
LOW_TEXTURE_MARGIN = 2.5

INNER_CROPS: tuple[tuple[float, float, float, float], ...] = ((0.1, 0.1, 0.1, 0.1), (0.12, 0.12, 0.12, 0.12))
INNER_TRIM: tuple[bool, ...] = (True, False)
CORPUS_CODES = 1 + len(INNER_CROPS)
CORPUS_SIGNATURE_BYTES = CORPUS_CODES * SIGNATURE_BYTES


def content_hash(img: Image.Image) -> str:
    """sha256 hex of the decoded pixels, mode and size: identical pixels <=> identical hash."""
    digest = hashlib.sha256(f"{img.mode}:{img.width}x{img.height}:".encode())
    digest.update(img.tobytes())
    return digest.hexdigest()


def _luminance_image(img: Image.Image) -> Image.Image:
    """Pillow's ``L`` luminance of any decoded image, as a mode ``F`` image (exact integers 0..255)."""
    if img.mode not in ("L", "RGB"):
        img = img.convert("RGB")
    if img.mode != "L":
        img = img.convert("L")
    return img.convert("F")


def luminance(img: Image.Image) -> np.ndarray:
    """float32 luminance in 0..255 of any decoded image (RGB, L, RGBA, P...)."""
    return np.asarray(_luminance_image(img), dtype=np.float32)


def trim_box(lum: np.ndarray | Image.Image, region: tuple[int, int, int, int] | None = None
             ) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the content inside uniform borders, in pixels of ``lum``.

    ``lum`` is what :func:`luminance` returns, or the same values as a mode ``F`` image.
    ``region`` (a mode ``F`` image only): trim that box of it instead, as if cropped (the
    same result as ``trim_box(lum.crop(region))``, without copying the region); the box
    returned is then in pixels of the region.
    """
    image = lum if isinstance(lum, Image.Image) else None
    if region is not None:
        w, h = region[2] - region[0], region[3] - region[1]
    else:
        h, w = (image.height, image.width) if image is not None else lum.shape
    scale = max(h, w) / _TRIM_PROXY
    if scale > 1:
        image = image if image is not None else Image.fromarray(lum)
        proxy = np.asarray(image.resize(
            (max(1, round(w / scale)), max(1, round(h / scale))), Image.BOX, box=region), dtype=np.float32)
    else:
        proxy = np.asarray(lum.crop(region) if region is not None else lum, dtype=np.float32)
        scale = 1.0
    ph, pw = proxy.shape

    def run(lines: np.ndarray, limit: int) -> int:
        edge = lines[0].mean()
        n = 0
        while n < limit:
            line = lines[n]
            if line.std() > _TRIM_STD or abs(line.mean() - edge) > _TRIM_MEAN:
                break
            n += 1
        return n

    # Repeat so a frame added around an image whose own margin is flat peels down
    # to the same content as the original: frame first, then the natural margin.
    left = top = 0
    right, bottom = pw, ph
    for _ in range(4):
        cur = proxy[top:bottom, left:right]
        ch, cw = cur.shape
        if ch < 8 or cw < 8:
            break
        t = run(cur, int(ph * _TRIM_MAX) - top)
        b = run(cur[::-1], int(ph * _TRIM_MAX) - (ph - bottom))
        l = run(cur.T, int(pw * _TRIM_MAX) - left)
        r = run(cur.T[::-1], int(pw * _TRIM_MAX) - (pw - right))
        if not (t or b or l or r):
            break
        top, bottom, left, right = top + t, bottom - b, left + l, right - r
    box = (round(left * scale), round(top * scale), w - round((pw - right) * scale), h - round((ph - bottom) * scale))
    if box[2] - box[0] < 8 or box[3] - box[1] < 8:
        return (0, 0, w, h)
    return box


def _coeffs(lum: np.ndarray | Image.Image, box: tuple[float, float, float, float] | None = None) -> np.ndarray:
    image = lum if isinstance(lum, Image.Image) else Image.fromarray(lum)
    small = np.asarray(image.resize((DCT_SIZE, DCT_SIZE), Image.BOX, box=box), dtype=np.float64)
    return dctn(small, norm="ortho")[_ROWS, _COLS]


def _bits(coeffs: np.ndarray) -> np.ndarray:
    return np.packbits(coeffs > np.median(coeffs))


def _margin(coeffs: np.ndarray) -> float:
    return float(np.median(np.abs(coeffs - np.median(coeffs))))


def _code(lum: np.ndarray | Image.Image, box: tuple[float, float, float, float] | None = None) -> np.ndarray:
    return _bits(_coeffs(lum, box))


def texture_margin(img: Image.Image) -> float:
    """Median distance of the code's DCT coefficients from their median (grey levels x 32).

    Each code bit says on which side of that median a coefficient lies, so this
    is how far a typical bit is from flipping. Flat colour and soft gradients
    have it near 0 (their bits are JPEG noise, or the same for every gradient of
    one direction); below ``LOW_TEXTURE_MARGIN`` an image is matched by its
    content hash only.
    """
    lum = _luminance_image(img)
    box = trim_box(lum)
    return _margin(_coeffs(lum.crop(box) if box != (0, 0, lum.width, lum.height) else lum))


def _crop(lum: np.ndarray, frac: tuple[float, float, float, float]) -> np.ndarray:
    h, w = lum.shape
    l, t, r, b = frac
    return lum[round(t * h): h - round(b * h), round(l * w): w - round(r * w)]


def compute(img: Image.Image) -> bytes:
    """The near-duplicate signature of a decoded image: ``SIGNATURE_BYTES`` bytes.

    The same bits as ``_code(trimmed luminance array)``, computed on a mode ``F``
    image so that the luminance is not copied into numpy and back.
    """
    lum = _luminance_image(img)
    box = trim_box(lum)
    if box != (0, 0, lum.width, lum.height):
        lum = lum.crop(box)
    return _code(lum).tobytes()


def corpus_codes(img: Image.Image) -> bytes:
    """What the corpus side stores and searches: ``CORPUS_SIGNATURE_BYTES`` bytes.

    The first ``SIGNATURE_BYTES`` are :func:`compute` (the forward direction: a
    corpus copy that is a crop of a test image); then one code per
    ``INNER_CROPS`` entry (:func:`inner_codes`; the reverse direction: a test
    image that is a crop of the corpus image).
    """
    lum = _luminance_image(img)
    box = trim_box(lum)
    if box != (0, 0, lum.width, lum.height):
        lum = lum.crop(box)
    h, w = lum.height, lum.width
    whole = _coeffs(lum)
    if _margin(whole) < LOW_TEXTURE_MARGIN:
        return b""  # low texture: exact (content hash) matches only
    return b"".join([_bits(whole).tobytes()] + [c.tobytes() for c in inner_codes(lum)])


def inner_codes(lum: Image.Image) -> list[np.ndarray]:
    """The ``INNER_CROPS`` codes of a trimmed mode ``F`` luminance image, trimmed again where ``INNER_TRIM`` says."""
    h, w = lum.height, lum.width
    out = []
    for (l, t, r, b), trim in zip(INNER_CROPS, INNER_TRIM):
        crop = (round(l * w), round(t * h), w - round(r * w), h - round(b * h))
        if not trim:
            out.append(_code(lum, crop))
            continue
        l, t, r, b = trim_box(lum, crop)  # the crop trimmed again, in its own pixels
        out.append(_code(lum, (crop[0] + l, crop[1] + t, crop[0] + r, crop[1] + b)))
    return out


def split_codes(stored: bytes) -> list[bytes]:
    """The codes of a stored corpus signature (:func:`corpus_codes`, or a bare :func:`compute`)."""
    if stored is None or len(stored) % SIGNATURE_BYTES:
        raise ValueError(f"corpus signature of {len(stored or b'')} bytes: expected a multiple of {SIGNATURE_BYTES}; "
                         f"recompute it with neardup.signatures.corpus_codes (signature version {SIGNATURE_VERSION})")
    return [stored[i: i + SIGNATURE_BYTES] for i in range(0, len(stored), SIGNATURE_BYTES)]


def variant_codes(img: Image.Image) -> np.ndarray:
    """Signatures of the test image under its crop variants: (variants, SIGNATURE_BYTES) uint8.

    Row ``k < len(CROP_VARIANTS)`` is ``CROP_VARIANTS[k]`` of the trimmed image
    (row 0 is :func:`compute`); the rows after them, at most
    ``len(CROP_VARIANTS)`` and only where they differ, are the same crops taken
    before trimming and then trimmed, as :func:`compute` sees a cropped copy.
    No rows for a low-texture image (``LOW_TEXTURE_MARGIN``).
    """
    raw = luminance(img)
    l, t, r, b = trim_box(raw)
    lum = raw[t:b, l:r]
    if _margin(_coeffs(lum)) < LOW_TEXTURE_MARGIN:  # low texture: exact matches only
        return np.zeros((0, SIGNATURE_BYTES), dtype=np.uint8)
    codes = [_code(_crop(lum, frac)) for frac in CROP_VARIANTS]
    # A crop can bring a flat part of the content (sky, a wall) onto the new
    # edge, and the query side then trims it away (up to _TRIM_MAX of a side):
    # no crop of the trimmed image looks like that. Indexing trim(crop(image))
    # too covers it exactly, since the trimmed edge stops where the content
    # starts whatever the crop; for images without flat regions these codes
    # equal the first ones and are dropped (its effect on recall: benchmarks/README.md).
    seen = {c.tobytes() for c in codes}
    for frac in CROP_VARIANTS:
        cropped = _crop(raw, frac)
        cl, ct, cr, cb = trim_box(cropped)
        code = _code(cropped[ct:cb, cl:cr])
        if code.tobytes() not in seen:
            seen.add(code.tobytes())
            codes.append(code)
    return np.stack(codes)


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
