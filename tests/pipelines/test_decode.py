"""pipelines.decode: every accepted format and mode to 8-bit RGB, every bad input to its reason."""
from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

import pipelines.decode as decode_mod
from pipelines.decode import ALPHA_BACKGROUND, BadImage, decode_image, rgbx_view


def _enc(img, fmt="JPEG", **kw):
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def astro(photos):
    return photos["astronaut"]


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"])
def test_every_accepted_format_decodes_to_rgb(astro, fmt):
    img = decode_image(_enc(astro, fmt), uri=f"x.{fmt.lower()}")
    assert img.mode == "RGB" and img.size == astro.size


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF"])
def test_lossless_formats_keep_exact_pixels(astro, fmt):
    img = decode_image(_enc(astro, fmt), uri="x")
    np.testing.assert_array_equal(np.asarray(img), np.asarray(astro))


def test_exif_orientation_is_applied(astro):
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: the viewer must rotate 90 degrees clockwise
    data = _enc(astro.rotate(90, expand=True), "PNG", exif=exif)
    img = decode_image(data, uri="rotated.png")
    np.testing.assert_array_equal(np.asarray(img), np.asarray(astro))


def test_exif_orientation_on_jpeg_swaps_the_size(photos):
    chelsea = photos["chelsea"]  # landscape
    exif = Image.Exif()
    exif[0x0112] = 8
    img = decode_image(_enc(chelsea, "JPEG", exif=exif), uri="rot.jpg")
    assert img.size == (chelsea.height, chelsea.width)


def test_rgba_is_composited_on_the_fixed_background():
    arr = np.zeros((40, 40, 4), np.uint8)
    arr[..., 0] = 200
    arr[:20, :, 3] = 255  # top half opaque red-ish, bottom half fully transparent
    img = decode_image(_enc(Image.fromarray(arr, "RGBA"), "PNG"), uri="a.png")
    out = np.asarray(img)
    assert tuple(out[5, 5]) == (200, 0, 0)
    assert tuple(out[35, 5]) == ALPHA_BACKGROUND


@pytest.mark.parametrize("mode", ["L", "LA", "P", "1", "CMYK"])
def test_other_modes_become_rgb(astro, mode):
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    src = astro.convert(mode)
    img = decode_image(_enc(src, fmt), uri=f"x.{mode}")
    assert img.mode == "RGB" and img.size == astro.size


def test_cmyk_jpeg_keeps_its_colours(astro):
    img = decode_image(_enc(astro.convert("CMYK"), "JPEG", quality=95), uri="cmyk.jpg")
    diff = np.abs(np.asarray(img, np.int16) - np.asarray(astro, np.int16)).mean()
    assert diff < 8


def test_palette_with_transparency_uses_the_background():
    img = Image.new("P", (32, 32), 1)
    img.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    img.info["transparency"] = 1
    out = decode_image(_enc(img, "GIF", transparency=1), uri="t.gif")
    assert tuple(np.asarray(out)[0, 0]) == ALPHA_BACKGROUND


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16_bit_gray_is_scaled_not_clipped(fmt):
    ramp = (np.linspace(0, 65535, 64 * 64).reshape(64, 64)).astype(np.uint16)
    img = decode_image(_enc(Image.fromarray(ramp), fmt), uri=f"g16.{fmt}")
    out = np.asarray(img)[..., 0].astype(int)
    np.testing.assert_allclose(out, np.rint(ramp / 257.0), atol=1)
    assert out.max() == 255 and out.min() == 0 and len(np.unique(out)) > 200


def test_gif_takes_the_first_frame():
    frames = [Image.new("RGB", (32, 32), c) for c in [(255, 0, 0), (0, 0, 255)]]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    out = np.asarray(decode_image(buf.getvalue(), uri="anim.gif"))
    assert out[..., 0].mean() > 200 and out[..., 2].mean() < 50


def test_multipage_tiff_takes_the_first_page():
    from common.photos import skimage_path

    data = skimage_path("multipage.tif").read_bytes()
    first = Image.open(io.BytesIO(data)).convert("RGB")
    np.testing.assert_array_equal(np.asarray(decode_image(data, uri="m.tif")), np.asarray(first))


def test_large_jpeg_is_drafted_at_reduced_scale(photos):
    big = photos["china"].resize((1600, 1200))
    data = _enc(big, "JPEG")
    img = decode_image(data, uri="big.jpg", draft_short_side=256)
    # 1/4 scale gives 400x300 >= 256 on the short side; 1/8 would be too small.
    assert img.size == (400, 300)


def test_draft_never_goes_below_the_target(photos):
    big = photos["china"].resize((1600, 1200))
    img = decode_image(_enc(big, "JPEG"), uri="big.jpg", draft_short_side=384)
    assert min(img.size) >= 384


# -- bad inputs: each kind maps to its reason -----------------------------------------------

def test_empty_file():
    with pytest.raises(BadImage) as e:
        decode_image(b"", uri="empty.jpg")
    assert e.value.reason == "empty_file" and "empty.jpg" in e.value.detail


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "BMP", "TIFF"])
def test_truncated_file(astro, fmt):
    data = _enc(astro, fmt)
    with pytest.raises(BadImage) as e:
        decode_image(data[: len(data) // 2], uri="cut")
    assert e.value.reason == "truncated"


def test_corrupt_header_with_image_signature():
    with pytest.raises(BadImage) as e:
        decode_image(b"\x89PNG\r\n\x1a\n" + os.urandom(200), uri="bad.png")
    assert e.value.reason in ("corrupt", "truncated")


def test_corrupt_data_stream(astro):
    data = bytearray(_enc(astro, "GIF"))
    data[len(data) // 3: len(data) // 3 + 400] = np.random.default_rng(0).bytes(400)
    with pytest.raises(BadImage) as e:
        decode_image(bytes(data), uri="garbled.gif")
    assert e.value.reason == "corrupt"


def test_not_an_image():
    with pytest.raises(BadImage) as e:
        decode_image(b"<html><body>404 Not Found</body></html>", uri="page.jpg")
    assert e.value.reason == "not_an_image"


@pytest.mark.parametrize("fmt", ["PPM", "ICO", "TGA"])
def test_unsupported_format(astro, fmt):
    with pytest.raises(BadImage) as e:
        decode_image(_enc(astro.resize((64, 64)), fmt), uri=f"x.{fmt.lower()}")
    assert e.value.reason == "unsupported_format"


def test_unsupported_heic_signature():
    with pytest.raises(BadImage) as e:
        decode_image(b"\x00\x00\x00\x18ftypheic" + bytes(64), uri="x.heic")
    assert e.value.reason == "unsupported_format"


def test_decompression_bomb_is_rejected_before_decoding():
    data = _enc(Image.new("L", (2000, 2000)), "PNG")  # 4 MP of zeros: a few KB on disk
    with pytest.raises(BadImage) as e:
        decode_image(data, uri="bomb.png", max_megapixels=1.0)
    assert e.value.reason == "decompression_bomb" and "4.0 MP" in e.value.detail


def test_pillow_bomb_limit_also_maps_to_decompression_bomb():
    data = _enc(Image.new("1", (14000, 14000)), "PNG")  # 196 MP: above Pillow's own hard limit
    with pytest.raises(BadImage) as e:
        decode_image(data, uri="huge.png", max_megapixels=1000.0)
    assert e.value.reason == "decompression_bomb"


def test_too_small(astro):
    with pytest.raises(BadImage) as e:
        decode_image(_enc(astro.resize((20, 40)), "PNG"), uri="tiny.png", min_short_side=32)
    assert e.value.reason == "too_small" and "20 px" in e.value.detail


def test_bad_image_pickles():
    import pickle

    exc = pickle.loads(pickle.dumps(BadImage("corrupt", "x: broken")))
    assert (exc.reason, exc.detail) == ("corrupt", "x: broken")


# -- the libjpeg-turbo path: the same pixels and verdicts as Pillow's own ------------------
# Every figure in benchmarks/ingest.py assumes it, and so does dedup, whose content hashes are
# of decoded pixels.

def _pillow_only(monkeypatch, data, **kw):
    with monkeypatch.context() as m:
        m.setattr(decode_mod, "simplejpeg", None)
        return decode_image(data, uri="pillow", **kw)


@pytest.fixture(scope="module")
def real_jpegs():
    """skimage's own JPEG files (camera photographs, as shipped) and sklearn's photos re-encoded."""
    from common.photos import SKLEARN, photo, skimage_path

    files = {n: skimage_path(n).read_bytes() for n in ("rocket.jpg", "retina.jpg", "hubble_deep_field.jpg")}
    files.update({n: _enc(photo(n), quality=92) for n in SKLEARN})
    return files


def test_the_fast_decoder_is_available():
    # A declared dependency: without it every JPEG silently takes the slower path.
    assert decode_mod.simplejpeg is not None


@pytest.mark.parametrize("draft", [None, 384, 200, 96, 40])
def test_fast_decode_matches_pillow_at_every_dct_scale(monkeypatch, real_jpegs, draft):
    for name, data in real_jpegs.items():
        fast = decode_image(data, uri=name, draft_short_side=draft)
        slow = _pillow_only(monkeypatch, data, draft_short_side=draft)
        assert fast.mode == slow.mode == "RGB" and fast.size == slow.size, name
        np.testing.assert_array_equal(np.asarray(fast), np.asarray(slow), err_msg=name)


@pytest.mark.parametrize("options", [
    {"subsampling": 0}, {"subsampling": 1}, {"subsampling": 2}, {"progressive": True},
    {"quality": 60, "subsampling": 2, "progressive": True},
])
def test_fast_decode_matches_pillow_for_every_jpeg_flavour(monkeypatch, photos, options):
    big = photos["china"].resize((1000, 750))
    data = _enc(big, **options)
    for draft in (None, 300, 100):
        np.testing.assert_array_equal(np.asarray(decode_image(data, uri="x", draft_short_side=draft)),
                                      np.asarray(_pillow_only(monkeypatch, data, draft_short_side=draft)))


def test_exif_orientation_applies_on_the_fast_path(monkeypatch, photos):
    exif = Image.Exif()
    exif[0x0112] = 6
    data = _enc(photos["china"].resize((800, 600)), exif=exif)
    fast = decode_image(data, uri="rot.jpg", draft_short_side=200)
    assert fast.size == (300, 400)
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(_pillow_only(monkeypatch, data, draft_short_side=200)))


def test_a_jpeg_with_a_libjpeg_warning_is_still_accepted(monkeypatch, photos):
    # Stray bytes before the end marker: libjpeg warns ("extraneous bytes before marker"),
    # the strict fast path refuses, and Pillow, which tolerates it, decides.
    data = _enc(photos["china"])
    assert data.endswith(b"\xff\xd9")
    data = data[:-2] + b"\x00\x00\x00" + data[-2:]
    img = decode_image(data, uri="warn.jpg")
    np.testing.assert_array_equal(np.asarray(img), np.asarray(_pillow_only(monkeypatch, data)))


def test_truncated_and_corrupt_jpegs_get_the_same_reason_on_both_paths(monkeypatch, photos):
    data = _enc(photos["china"].resize((640, 480)))
    cut = data[: len(data) // 2]
    garbled = bytearray(data)
    garbled[600:2000] = os.urandom(1400)
    for bad in (cut, bytes(garbled)):
        reasons = []
        for fast in (True, False):
            with monkeypatch.context() as m:
                if not fast:
                    m.setattr(decode_mod, "simplejpeg", None)
                try:
                    decode_image(bad, uri="bad.jpg")
                    reasons.append("accepted")
                except BadImage as exc:
                    reasons.append(exc.reason)
        assert reasons[0] == reasons[1], reasons
    with pytest.raises(BadImage) as err:
        decode_image(cut, uri="cut.jpg")
    assert err.value.reason == "truncated"


def test_a_decoded_image_is_an_ordinary_pillow_image(photos):
    img = decode_image(_enc(photos["china"].resize((800, 600))), uri="x", draft_short_side=200)
    view, _ = rgbx_view(img)
    assert view.shape == (300, 400, 4) and not view.flags.writeable
    np.testing.assert_array_equal(view[..., :3], np.asarray(img))
    before = np.asarray(img).copy()
    copy = img.copy()
    copy.paste((1, 2, 3), (0, 0, 10, 10))  # writable, and independent of the original
    assert tuple(np.asarray(copy)[5, 5]) == (1, 2, 3)
    np.testing.assert_array_equal(np.asarray(img), before)
    assert img.convert("L").size == img.size and len(img.tobytes()) == 300 * 400 * 3


# -- headers that claim more pixels than the data holds ----------------------------------------

def _png_chunk(kind: bytes, body: bytes) -> bytes:
    import struct
    import zlib

    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _lying_png(width: int, height: int, rows: int, interlace: int = 0) -> bytes:
    import struct
    import zlib

    raw = b"".join(b"\x00" + bytes([80 + r % 100]) * (width * 3) for r in range(rows))
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, interlace))
            + _png_chunk(b"IDAT", zlib.compress(raw, 9)) + _png_chunk(b"IEND", b""))


def test_a_png_whose_data_ends_before_its_header_says_is_truncated():
    data = _lying_png(8000, 8000, rows=2)
    assert len(data) < 400
    with pytest.raises(BadImage) as e:
        decode_image(data, uri="liar.png")
    assert e.value.reason == "truncated" and "8000x8000" in e.value.detail and "liar.png" in e.value.detail
    # The same file with every row is an image.
    whole = _lying_png(64, 48, rows=48)
    assert decode_image(whole, uri="ok.png").size == (64, 48)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_honest_interlaced_and_progressive_files_pass_the_length_check(astro, fmt):
    kw = {"optimize": True} if fmt == "PNG" else {"progressive": True}
    img = decode_image(_enc(astro, fmt, **kw), uri="x")
    assert img.size == astro.size
    # 16-bit grey and palette PNGs inflate to other row sizes.
    arr = (np.arange(64 * 40, dtype=np.uint16).reshape(40, 64) * 20)
    assert decode_image(_enc(Image.fromarray(arr, "I;16"), "PNG"), uri="g16").size == (64, 40)
    assert decode_image(_enc(astro.convert("P"), "PNG"), uri="p").size == astro.size


def _lying_jpeg(photos, size: int) -> bytes:
    import struct

    data = bytearray(_enc(photos["china"].resize((64, 64))))
    sof = data.find(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, size, size)
    return bytes(data)


@pytest.mark.parametrize("draft", [None, 224])
def test_a_jpeg_whose_scan_ends_before_its_header_says_is_truncated_on_both_paths(monkeypatch, photos, draft):
    data = _lying_jpeg(photos, 9000)
    assert len(data) < 3000
    for fast in (True, False):
        with monkeypatch.context() as m:
            if not fast:
                m.setattr(decode_mod, "simplejpeg", None)
            with pytest.raises(BadImage) as e:
                decode_image(data, uri="liar.jpg", draft_short_side=draft)
            assert e.value.reason == "truncated" and "9000x9000" in e.value.detail
    # A grey JPEG is checked in its own colour space.
    grey = _enc(photos["china"].convert("L"))
    assert decode_image(grey, uri="grey.jpg").size == photos["china"].size
