"""pipelines.process: the in-place resize and encode give the bytes of the plain Pillow path, safely."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from PIL import Image

from pipelines.decode import decode_image, rgbx_view
from pipelines.process import ProcessOptions, encode, resize, resize_encode


@pytest.mark.parametrize("size,opts", [
    ((1000, 750), {}),
    ((1000, 750), {"store": "raw"}),
    ((750, 1000), {"max_long_side": 300}),
    ((300, 200), {}),  # smaller than the target: kept as is
    ((300, 200), {"upscale": True}),
    ((2400, 1800), {"size": 2000}),  # decoded whole: 17 MB, more than one Pillow memory block
])
def test_resize_encode_gives_the_bytes_of_resize_then_encode(photos, enc, size, opts):
    o = ProcessOptions(**{"size": 384, **opts})
    img = decode_image(enc(photos["china"].resize(size), "JPEG"), uri="x", draft_short_side=o.size,
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
