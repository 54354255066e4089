"""Decode and validate one image: bytes in, 8-bit RGB ``PIL.Image`` out, or :class:`BadImage`.

This is the single decoder of the project: the Beam ingest uses it for the
corpus and ``dedup`` uses it for test sets, so both see the same pixels for the
same file. It imports neither Beam nor Ray.

Ordinary colour JPEGs (the bulk of every corpus) are decoded by libjpeg-turbo
through ``simplejpeg``, straight into the memory of a new Pillow image
(:func:`_decode_jpeg_turbo`), which is faster than Pillow's own path that
reads the file in 64 KB chunks and repacks every row (figures:
benchmarks/README.md). Both bundle libjpeg-turbo
with the same integer IDCT and fancy upsampling, and the tests check that
their pixels are identical. Any file the strict fast path refuses (truncated,
corrupt, or merely carrying a libjpeg warning that Pillow tolerates) goes
through Pillow, which gives the verdict; so the reasons below do not depend on
which decoder ran.

Accepted formats are those of the pre-training corpora the paper uses
(ImageNet, ImageNet-21k, JFT): JPEG (including camera MPO files), PNG, WebP,
GIF (first frame), BMP and TIFF (first page). Everything else is rejected with
a stable reason string (:data:`REASONS`) that the quarantine file and the
manifest counts use.
"""
from __future__ import annotations

import ctypes
import io
import math
import struct
import warnings
import zlib

import numpy as np
import pyarrow as pa
from PIL import Image, UnidentifiedImageError

try:
    import simplejpeg
except ImportError:  # a declared dependency; without it Pillow decodes every JPEG
    simplejpeg = None
# The same library, for the check that a JPEG's data covers its header (_jpeg_scan_ends_early),
# which runs whichever decoder gave the pixels.
_jpeg_checker = simplejpeg

#: Reasons an input can be rejected. They are part of the output format
#: (``quarantine.jsonl`` and ``manifest["counts"]["rejected"]``); do not rename.
REASONS = (
    "empty_file",  # zero bytes
    "truncated",  # the file ends before the image data does
    "corrupt",  # a known image format whose data cannot be decoded
    "not_an_image",  # no image signature at all (text, HTML error pages, ...)
    "sample_without_image",  # a WebDataset sample (members sharing a key) with no image member
    "unsupported_format",  # an image, but not one of ALLOWED_FORMATS
    "decompression_bomb",  # more pixels than max_megapixels
    "too_large",  # a file of more bytes than max_file_mb, not read beyond that
    "too_small",  # shorter side below min_short_side
    "unknown_label",  # a label that the given label map does not list
    "bad_label",  # a label sidecar or column that holds no class (a .cls that is not an integer)
    "unreadable",  # the source could not be read (missing file, bad archive member)
    "not_a_regular_file",  # a FIFO, device, socket or /proc entry: refused from its stat, never opened
    "outside_allowed_roots",  # --allowed-roots is set and the item (its real path) lies under none of them
    "corrupt_archive",  # a tar archive that cannot be read to the end
    "bad_manifest_row",  # a manifest row without a usable uri
    "unexpected_error",  # the dead-letter path: any other exception, with its type and message
)

ALLOWED_FORMATS = frozenset({"JPEG", "MPO", "PNG", "WEBP", "GIF", "BMP", "DIB", "TIFF"})

#: Alpha is composited on a fixed background so that the same file always
#: gives the same pixels (and the same content hash).
ALPHA_BACKGROUND = (255, 255, 255)

DEFAULT_MAX_MEGAPIXELS = 89.0  # Pillow's own bomb threshold, made explicit and configurable
# Bytes, as megapixels bound pixels: every item is read whole and crosses the runner, so a
# multi-GB video in a crawled folder could exhaust a worker's memory. 1 GB still admits any
# image max_megapixels does (89 MP of uncompressed 16-bit RGBA is 712 MB).
DEFAULT_MAX_FILE_MB = 1024.0

_DRAFT_FORMATS = frozenset({"JPEG", "MPO"})

# EXIF orientation tag (0x0112) -> the transpose that undoes it.
_ORIENTATION = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}

# Signatures of image formats we know, to tell "a broken image" from "not an image".
_IMAGE_MAGIC = (
    b"\xff\xd8\xff",  # JPEG
    b"\x89PNG\r\n\x1a\n",
    b"GIF87a",
    b"GIF89a",
    b"BM",
    b"II*\x00",  # TIFF little-endian
    b"MM\x00*",  # TIFF big-endian
)
_UNSUPPORTED_MAGIC = (
    b"8BPS",  # Photoshop
    b"\x00\x00\x01\x00",  # ICO
    b"\xff\x0a",  # JPEG XL codestream
    b"\x00\x00\x00\x0cJXL ",  # JPEG XL container
    b"\x00\x00\x00\x0cjP  ",  # JPEG 2000
)


class BadImage(Exception):
    """An input that cannot become a training image.

    ``reason`` is one of :data:`REASONS`; ``detail`` says what was found, for a human.
    """

    def __init__(self, reason: str, detail: str):
        if reason not in REASONS:
            raise ValueError(f"BadImage reason {reason!r} is not one of {REASONS}")
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"

    def __reduce__(self):
        return (BadImage, (self.reason, self.detail))


def _sniff(data: bytes) -> str:
    """'image', 'unsupported' or 'unknown', from the first bytes alone."""
    head = data[:32]
    if head.startswith(_IMAGE_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"):
        return "image"
    if head.startswith(_UNSUPPORTED_MAGIC) or (head[4:8] == b"ftyp" and head[8:12] in (
        b"heic", b"heix", b"hevc", b"mif1", b"msf1", b"avif", b"avis"
    )):
        return "unsupported"
    return "unknown"


# Types a non-image commonly turns out to be, by signature: named in the quarantine record
# instead of the file's bytes, which may be anything the job can read (/etc/passwd, a token).
_OTHER_MAGIC = (
    (b"%PDF", "PDF document"), (b"PK\x03\x04", "ZIP archive"), (b"\x1f\x8b", "gzip data"),
    (b"BZh", "bzip2 data"), (b"\xfd7zXZ\x00", "xz data"), (b"7z\xbc\xaf", "7-zip archive"),
    (b"\x7fELF", "ELF executable"), (b"MZ", "Windows executable"), (b"\x00asm", "WebAssembly module"),
    (b"ARROW1", "Arrow file"), (b"PAR1", "Parquet file"), (b"SQLite format 3", "SQLite database"),
    (b"OggS", "Ogg media"), (b"ID3", "MP3 audio"), (b"\x1aE\xdf\xa3", "Matroska/WebM video"),
    (b"\x93NUMPY", "NumPy array"), (b"\x80\x04", "Python pickle"), (b"\x80\x05", "Python pickle"),
)


def describe_non_image(data: bytes) -> str:
    """What a file that is no image is (``"HTML document"``, ``"text"``, ``"binary data"``), never its bytes."""
    head = data[:512]
    for magic, name in _OTHER_MAGIC:
        if head.startswith(magic):
            return name
    if head[4:8] == b"ftyp":
        return "MP4/QuickTime media"
    if head[:4] == b"RIFF":
        return "RIFF media"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        text = head[:exc.start].decode("utf-8") if exc.start >= len(head) - 3 else None
    if text is None or "\x00" in text:
        return "binary data"
    lower = text.lstrip("\ufeff \t\r\n").lower()
    if lower.startswith(("<!doctype html", "<html", "<head", "<body")):
        return "HTML document"
    if lower.startswith("<svg") or ("<svg" in lower and lower.startswith("<?xml")):
        return "SVG image (vector, not accepted)"
    if lower.startswith("<?xml"):
        return "XML document"
    if lower.startswith(("{", "[")):
        return "JSON or other text"
    return "text"


def _load_error(exc: Exception, uri: str) -> BadImage:
    text = str(exc)
    if "truncat" in text.lower() or isinstance(exc, EOFError):
        return BadImage("truncated", f"{uri}: {text}")
    return BadImage("corrupt", f"{uri}: {type(exc).__name__}: {text}")


def _to_rgb(img: Image.Image) -> Image.Image:
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        out = Image.new("RGB", rgba.size, ALPHA_BACKGROUND)
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    if mode.startswith("I;16") or mode == "I":
        # 16-bit sources (PNG/TIFF) keep their full range: scale 0..65535 to 0..255
        # instead of letting convert() clip everything above 255 to white.
        arr = np.asarray(img, dtype=np.float64)
        arr = np.clip(np.rint(arr / 257.0), 0, 255).astype(np.uint8)
        return Image.fromarray(arr, "L").convert("RGB")
    if mode == "F":
        arr = np.asarray(img, dtype=np.float64)
        if np.nanmax(arr, initial=0.0) <= 1.0:
            arr = arr * 255.0
        arr = np.clip(np.nan_to_num(np.rint(arr)), 0, 255).astype(np.uint8)
        return Image.fromarray(arr, "L").convert("RGB")
    return img.convert("RGB")


def _orientation(img: Image.Image) -> int:
    try:
        value = img.getexif().get(0x0112, 1)
        return int(value) if int(value) in _ORIENTATION else 1
    except Exception:  # a broken EXIF block must not cost the image; it just has no orientation
        return 1


def _draft_denominator(width: int, height: int, request: tuple[int, int]) -> int:
    """The DCT scale 1/s that ``JpegImageFile.draft(mode, request)`` picks (Pillow's own rule)."""
    fit = min(width // request[0], height // request[1])
    return next(s for s in (8, 4, 2, 1) if fit >= s)


def rgbx_view(img: Image.Image, writable: bool = False) -> tuple[np.ndarray, object] | None:
    """(H, W, 4) uint8 view of an RGB image's own memory, and the object that keeps it alive.

    Pillow stores RGB as 4 bytes a pixel (the 4th is padding) and exports that
    buffer through the Arrow C data interface without copying. ``np.asarray(img)``
    would repack it to 3 bytes a pixel instead. Returns None when Pillow holds
    the image in several memory blocks (larger than its 16 MB block size), which
    cannot be viewed whole. The view is valid only while the returned owner is
    referenced. ``writable`` views are for filling a freshly allocated image.
    """
    if img.mode != "RGB":
        return None
    try:
        cells = pa.array(img)
    except (ValueError, TypeError, pa.ArrowException):
        return None
    buf = cells.values.buffers()[1]
    if buf is None or buf.size < img.width * img.height * 4:
        return None
    if writable:
        # Arrow marks exports immutable; this image is new and nobody else sees it yet.
        arr = np.frombuffer((ctypes.c_uint8 * buf.size).from_address(buf.address), dtype=np.uint8)
    else:
        arr = np.frombuffer(buf, dtype=np.uint8)
    return arr[: img.width * img.height * 4].reshape(img.height, img.width, 4), cells


def _decode_jpeg_turbo(data: bytes, width: int, height: int, denom: int) -> Image.Image | None:
    """A colour JPEG decoded at scale 1/denom by libjpeg-turbo, or None to let Pillow decide.

    The pixels are written straight into the memory of a new Pillow image, so the
    result is an ordinary ``Image`` and nothing is copied.
    """
    if simplejpeg is None:
        return None
    out_w, out_h = -(-width // denom), -(-height // denom)
    if out_w * out_h * 4 > Image.core.get_block_size():
        return None  # Pillow would split it over several memory blocks, which cannot be filled as one
    img = Image.new("RGB", (out_w, out_h), None)  # None: not initialised; the decoder fills every pixel
    view = rgbx_view(img, writable=True)
    if view is None:
        return None
    try:
        if simplejpeg.decode_jpeg_header(data, min_width=out_w, min_height=out_h)[:2] != (out_h, out_w):
            return None  # a scale Pillow would not pick: keep the two paths' pixels equal
        simplejpeg.decode_jpeg(data, colorspace="RGBX", min_width=out_w, min_height=out_h, strict=True,
                               buffer=view[0])
    except (ValueError, RuntimeError, MemoryError):
        return None
    return img


_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
# Adam7 passes: (x start, y start, x step, y step).
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def _png_rows_bytes(width: int, height: int, depth: int, colour: int, interlaced: bool) -> int:
    """Bytes of filtered pixel data (a filter byte per row) an image of this header inflates to."""
    bits = _PNG_CHANNELS.get(colour, 4) * depth
    passes = _ADAM7 if interlaced else ((0, 0, 1, 1),)
    total = 0
    for x0, y0, dx, dy in passes:
        w, h = -(-(width - x0) // dx) if width > x0 else 0, -(-(height - y0) // dy) if height > y0 else 0
        if w and h:
            total += h * (1 + -(-w * bits // 8))
    return total


def _png_data_ends_early(data: bytes) -> str | None:
    """How much pixel data a PNG lacks, or None when its IDAT stream covers the header's size.

    Pillow's zlib decoder stops without an error where the stream ends, and leaves the rows
    it never got black: a 312-byte file that claims 8000 x 8000 pixels decodes "fine".
    """
    try:
        width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", data[16:29])
    except struct.error:
        return None
    need = _png_rows_bytes(width, height, depth, colour, bool(interlace))
    inflate, got, pos = zlib.decompressobj(), 0, 8
    try:
        while pos + 8 <= len(data) and got < need:
            length, kind = struct.unpack(">I4s", data[pos:pos + 8])
            if kind == b"IEND":
                break
            if kind == b"IDAT":
                chunk = data[pos + 8:pos + 8 + length]
                while chunk and got < need:
                    got += len(inflate.decompress(chunk, 1 << 22))
                    chunk = inflate.unconsumed_tail
            pos += 12 + length
    except zlib.error:
        return None  # Pillow decoded it; a stream zlib refuses here is not this check's verdict
    return None if got >= need else f"{got} of {need} bytes of pixel data"


def _jpeg_scan_ends_early(data: bytes) -> str | None:
    """libjpeg's warning when a JPEG's entropy-coded data ends before its last block, or None.

    libjpeg fills the missing blocks with grey and only warns, and Pillow does not pass the
    warning on: a 700-byte file that claims 9000 x 9000 pixels decodes to flat grey. The check
    decodes at 1/8 scale, which still reads every coefficient. Without simplejpeg it cannot run.
    """
    if _jpeg_checker is None:
        return None
    try:
        space = _jpeg_checker.decode_jpeg_header(data)[2]
        _jpeg_checker.decode_jpeg(data, colorspace={"Gray": "GRAY", "CMYK": "CMYK", "YCCK": "CMYK"}.get(space, "RGB"),
                                  min_width=1, min_height=1, strict=True)
    except (ValueError, RuntimeError, MemoryError) as exc:
        return str(exc) if "premature end" in str(exc).lower() else None
    return None


def _open(data: bytes, uri: str) -> Image.Image:
    """``data`` opened lazily (header parsed, pixels not yet decoded); BadImage names what it is instead."""
    try:
        return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise BadImage("decompression_bomb", f"{uri}: {exc}") from None
    except UnidentifiedImageError:
        kind = _sniff(data)
        if kind == "image":
            raise BadImage("corrupt", f"{uri}: image signature found but the header cannot be parsed") from None
        if kind == "unsupported":
            raise BadImage("unsupported_format", f"{uri}: image format not supported; convert to JPEG or PNG") from None
        raise BadImage("not_an_image", f"{uri}: not an image ({describe_non_image(data)}, {len(data)} bytes)") from None
    except Exception as exc:  # Pillow's plugins raise OSError, SyntaxError, struct.error...
        raise _load_error(exc, uri) from None


def _check_header(img: Image.Image, uri: str, max_megapixels: float, min_short_side: int) -> str:
    """The image's format, once its header passes the format, size and short-side limits."""
    fmt = img.format or "?"
    if fmt not in ALLOWED_FORMATS:
        raise BadImage("unsupported_format", f"{uri}: {fmt} images are not accepted; convert to JPEG or PNG")
    width, height = img.size
    megapixels = width * height / 1e6
    if megapixels > max_megapixels:
        raise BadImage(
            "decompression_bomb",
            f"{uri}: {width}x{height} is {megapixels:.1f} MP, above max_megapixels={max_megapixels:g}",
        )
    short_side = min(width, height)
    if short_side < min_short_side:
        raise BadImage("too_small", f"{uri}: shorter side {short_side} px is below min_short_side={min_short_side}")
    return fmt


def _draft_request(width: int, height: int, draft_short_side: int | None,
                   draft_max_long_side: int | None) -> tuple[int, int] | None:
    """The size to ask a JPEG's DCT scaling for, or None to decode it at full size."""
    if not draft_short_side:
        return None
    scale = draft_short_side / min(width, height)
    if draft_max_long_side:
        scale = min(scale, draft_max_long_side / max(width, height))
    if scale >= 1.0:
        return None
    # The largest DCT reduction whose output is still at least the
    # requested size, so the final resize only ever shrinks.
    return math.ceil(width * scale), math.ceil(height * scale)


def _load_rgb(img: Image.Image, data: bytes, uri: str, fmt: str, request: tuple[int, int] | None) -> Image.Image:
    """The pixels of ``img`` in mode RGB, by Pillow (at ``request``'s DCT scale), checked for data that ends early."""
    width, height = img.size
    if request:
        img.draft("RGB", request)
    try:
        img.load()
    except Image.DecompressionBombError as exc:
        raise BadImage("decompression_bomb", f"{uri}: {exc}") from None
    except Exception as exc:
        raise _load_error(exc, uri) from None
    short = _png_data_ends_early(data) if fmt == "PNG" else (
        _jpeg_scan_ends_early(data) if fmt in _DRAFT_FORMATS else None)
    if short:
        raise BadImage("truncated", f"{uri}: {width}x{height} in the header, but the image data ends early ({short})")
    try:
        return _to_rgb(img)
    except Exception as exc:
        raise BadImage("corrupt", f"{uri}: cannot convert mode {img.mode} to RGB: {exc}") from None


def decode_image(
    data: bytes,
    *,
    uri: str,
    max_megapixels: float = DEFAULT_MAX_MEGAPIXELS,
    draft_short_side: int | None = None,
    draft_max_long_side: int | None = None,
    min_short_side: int = 0,
) -> Image.Image:
    """Decode ``data`` to an 8-bit RGB image with the EXIF orientation applied.

    Args:
        data: the encoded file.
        uri: where it came from; used in error details only.
        max_megapixels: reject images with more pixels than this before decoding them.
        draft_short_side: the caller will resize the shorter side to this; a JPEG is
            then decoded at the smallest DCT scale (1/2, 1/4, 1/8) that still gives
            at least this many pixels on the shorter side, which is much faster.
        draft_max_long_side: the caller also caps the longer side to this; lets
            the DCT scale go further for very elongated images.
        min_short_side: reject images whose (oriented) shorter side is below this.

    Returns:
        A loaded ``PIL.Image.Image`` in mode ``RGB``.

    Raises:
        BadImage: with ``reason`` from :data:`REASONS`.
    """
    if data is None:
        raise BadImage("unreadable", f"{uri}: no bytes; the source could not be read (see SourceItem.read)")
    if not data:
        raise BadImage("empty_file", f"{uri}: file is empty (0 bytes)")
    with warnings.catch_warnings():
        # Pillow warns at 89 MP; our own max_megapixels check decides instead.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        warnings.simplefilter("ignore", UserWarning)  # "Corrupt EXIF data" and friends
        img = _open(data, uri)
        fmt = _check_header(img, uri, max_megapixels, min_short_side)
        orientation = _orientation(img)
        width, height = img.size
        request = _draft_request(width, height, draft_short_side, draft_max_long_side) \
            if fmt in _DRAFT_FORMATS else None
        fast = None
        if fmt in _DRAFT_FORMATS and img.mode == "RGB":
            denom = _draft_denominator(width, height, request) if request else 1
            fast = _decode_jpeg_turbo(data, width, height, denom)
        img = fast if fast is not None else _load_rgb(img, data, uri, fmt, request)
    if orientation != 1:
        img = img.transpose(_ORIENTATION[orientation])
    return img
