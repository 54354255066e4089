"""The fast JPEG path (libjpeg-turbo into Pillow's memory, in-place resize and encode) against Pillow's own.

Every figure in ``benchmarks/ingest.py`` assumes these paths give the same pixels and
bytes as the plain Pillow code they replace; so does dedup, whose content hashes
are of decoded pixels.
"""
from __future__ import annotations

import io
import os
import threading

import numpy as np
import pytest
from PIL import Image

import pipelines.decode as decode_mod
from pipelines.decode import BadImage, decode_image, rgbx_view
from pipelines.process import ProcessOptions, encode, resize, resize_encode


def _enc(img, fmt="JPEG", **kw):
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _pillow_only(monkeypatch, data, **kw):
    with monkeypatch.context() as m:
        m.setattr(decode_mod, "simplejpeg", None)
        return decode_image(data, uri="pillow", **kw)


@pytest.fixture(scope="module")
def real_jpegs():
    """skimage's own JPEG files (camera photographs, as shipped) and sklearn's photos re-encoded."""
    import skimage
    from sklearn.datasets import load_sample_images

    d = os.path.join(os.path.dirname(skimage.__file__), "data")
    files = {n: open(os.path.join(d, n), "rb").read() for n in ("rocket.jpg", "retina.jpg", "hubble_deep_field.jpg")}
    for fname, arr in zip(load_sample_images().filenames, load_sample_images().images):
        files[os.path.basename(fname)] = _enc(Image.fromarray(arr), quality=92)
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


@pytest.mark.parametrize("size,opts", [
    ((1000, 750), {}),
    ((1000, 750), {"store": "raw"}),
    ((750, 1000), {"max_long_side": 300}),
    ((300, 200), {}),  # smaller than the target: kept as is
    ((300, 200), {"upscale": True}),
    ((2400, 1800), {"size": 2000}),  # decoded whole: 17 MB, more than one Pillow memory block
])
def test_resize_encode_gives_the_bytes_of_resize_then_encode(photos, size, opts):
    o = ProcessOptions(**{"size": 384, **opts})
    img = decode_image(_enc(photos["china"].resize(size)), uri="x", draft_short_side=o.size,
                       draft_max_long_side=o.max_long_side)
    data, fmt, width, height = resize_encode(img, o)
    ref = resize(img, o.size, o.max_long_side, o.upscale)
    assert (width, height) == ref.size and fmt == o.store
    assert data == encode(ref, o.store, o.quality)[0]


def test_resize_encode_of_non_rgb_and_multi_block_images(photos):
    gray = photos["camera"].resize((900, 700))
    data, fmt, w, h = resize_encode(gray, ProcessOptions())
    assert data == encode(resize(gray, 384), "jpeg", 90)[0]
    big = Image.fromarray(np.asarray(photos["china"].resize((2500, 2000))))  # 20 MB: several blocks
    assert rgbx_view(big) is None
    data, fmt, w, h = resize_encode(big, ProcessOptions())
    assert data == encode(resize(big, 384), "jpeg", 90)[0] and (w, h) == (480, 384)


def test_resize_encode_is_thread_safe(photos):
    # The resize buffer is per thread: concurrent workers never see each other's pixels.
    imgs = [photos[n].resize((700 + 37 * i, 500 + 11 * i)) for i, n in enumerate(("china", "flower", "astronaut", "coffee"))]
    want = [resize_encode(im, ProcessOptions(size=256)) for im in imgs]
    got: dict[tuple[int, int], tuple] = {}

    def work(t):
        for r in range(20):
            i = (t + r) % len(imgs)
            got[(t, r)] = (i, resize_encode(imgs[i], ProcessOptions(size=256)))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(got) == 80 and all(out == want[i] for i, out in got.values())
