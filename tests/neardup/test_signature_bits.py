"""Every output of neardup.signatures, pinned bit for bit on a spread of images.

Stored test-set indexes, incremental dedup state and the calibration hold these bits; a
change that only makes the code faster must reproduce them exactly (a change that moves
them needs a new SIGNATURE_VERSION and a fresh calibration). The digests were recorded
with signature version 6 as first merged (main at 0011580).
"""
import hashlib

import numpy as np
import pytest
from PIL import Image

from common.photos import photo
from neardup import signatures as sig
from neardup.transforms import apply


def _synthetic(name: str) -> Image.Image:
    """Images whose codes come from few or no real coefficients: flat, gradients, stripes, noise."""
    y, x = np.mgrid[0:150, 0:200]
    if name == "flat_grey":
        return Image.new("RGB", (200, 150), (120, 120, 120))
    if name == "gradient":
        return Image.fromarray((x * 255 // 199).astype(np.uint8)).convert("RGB")
    if name == "stripes":
        return Image.fromarray(np.where(x // 10 % 2, 200, 40).astype(np.uint8))
    if name == "noise":
        return Image.fromarray(np.random.default_rng(0).integers(0, 256, (150, 200, 3), dtype=np.uint8))
    if name == "rgba":
        return photo("chelsea.png").convert("RGBA")
    if name == "palette":
        return photo("coffee.png").convert("P")
    if name == "strip":  # thinner than the proxy scale: one proxy row
        return photo("rocket.jpg").resize((1000, 30))
    raise KeyError(name)


def _case(name: str) -> Image.Image:
    """``photo[@max_side|xN][+transform]`` or a synthetic image; camera.png stays in mode L."""
    if name in {"flat_grey", "gradient", "stripes", "noise", "rgba", "palette", "strip"}:
        return _synthetic(name)
    base, _, transform = name.partition("+")
    base, _, size = base.partition("@")
    img = photo(base, mode=None if base == "camera.png" else "RGB")
    if size.startswith("x"):  # enlarged: a row-sampled proxy at a larger scale
        f = float(size[1:])
        img = img.resize((round(img.width * f), round(img.height * f)), Image.Resampling.BICUBIC)
    elif size:
        img.thumbnail((int(size), int(size)))
    return apply(transform, img) if transform else img


def _digest(img: Image.Image) -> str:
    """sha256 over every public output of neardup.signatures for ``img``."""
    parts = [
        sig.compute(img),
        sig.corpus_codes(img),
        sig.corpus_codes_any_texture(img).tobytes(),
        sig.variant_codes(img).tobytes(),
        sig.variant_codes(img, any_texture=True).tobytes(),
        repr(sig.texture_margin(img)).encode(),
        repr(sig.trim_box(img)).encode(),
        repr(sig.trim_box(sig.luminance(img))).encode(),
    ]
    return hashlib.sha256(b"|".join(parts)).hexdigest()[:24]


# name -> digest, as signature version 6 computed them before its numpy passes were cut (same bits)
PINNED = {
    'astronaut.png': '26714e1fad5ce3b68d8987e3',
    'astronaut.png@200': '0489085fd10d40e1fdf40254',
    'astronaut.png@64': 'c73ba5c70d3fed60ffc322f5',
    'camera.png': '319d63936f96a59ed5b3cd65',
    'camera.png@200': '8e29cf2dcdb366f4bbfc81a4',
    'camera.png@64': '993a6cabafe2aff3578384a1',
    'china.jpg': '0e6fd5b716561659d4dd625b',
    'china.jpg@200': '076469f349745eaf180e8a42',
    'china.jpg@64': 'ba263a6b1c7acb147cfc628a',
    'coffee.png': 'cdd640a797e77574d96613d4',
    'coffee.png@200': 'f3cfad48a57000d6f2606a3a',
    'coffee.png@64': 'd7ff4fc1258d72c55c58932b',
    'brick.png': 'cb5d09dc5b2a10c796763f03',
    'brick.png@200': 'f5c29205cec9d72947233aa9',
    'brick.png@64': '1d129e46983f99f76c49820c',
    'moon.png': '687678e124deb7b1884f24ec',
    'moon.png@200': '5aa239af5f6f0a3034674502',
    'moon.png@64': '1683fe8bddbb44b634a9a487',
    'rocket.jpg': '2bf0b1754dd364c944919c72',
    'rocket.jpg@200': '9ba0463e05aa3cf9ca438f95',
    'rocket.jpg@64': '3e6125097b35b09bcd28a0d4',
    'flower.jpg': 'ceafec7f8cb5b6d0c1d40ea8',
    'flower.jpg@200': 'c0a5d3b1605deee771d70988',
    'flower.jpg@64': '2b58b11b4de7270446f6fbd1',
    'china.jpg@400': '0f273e08a6098568147d9def',
    'astronaut.png@x5': '2a2c30ac822127fe76b44780',
    'astronaut.png@x1.4': '8913129e57e3a91c1804b04e',
    'chelsea.png@x2': '16e73802f7ce61695f82baaa',
    'hubble_deep_field.jpg': '0f91d911c6520726bfbd3221',
    'coins.png@300': 'd64298a577db1becbcf1e6d4',
    'astronaut.png+border_10_white': '020a3c0f98838bc1eaa02826',
    'china.jpg@300+border_10_white': 'a02d7d7a713a58802153fdb8',
    'astronaut.png+border_10_black': '06a34237fd3a0d02a1a44beb',
    'china.jpg@300+border_10_black': 'be2533b8c09e169f739e209f',
    'astronaut.png+border_5_color': '25d09ad264516fac9bbb6acb',
    'china.jpg@300+border_5_color': '6fd40f14156fd18dc99b4fc3',
    'astronaut.png+crop_10_all': 'e3c6a0958f8e51d84e744a77',
    'china.jpg@300+crop_10_all': '45d8a893a3cebbd1fcfbaddd',
    'astronaut.png+crop_random': 'c5ebaac9c3fd160fec793289',
    'china.jpg@300+crop_random': '7f9ca05601b50eb93b265ec1',
    'astronaut.png+grayscale': '26714e1fad5ce3b68d8987e3',
    'china.jpg@300+grayscale': 'e01eab6aa5f977ef778675dd',
    'astronaut.png+jpeg_q30': 'b98578e3b73bcf66a16b7b54',
    'china.jpg@300+jpeg_q30': 'f97d2f2090a133d2b11f1d08',
    'astronaut.png+resize_0.25': 'c80dcc836d3d4de43456a17c',
    'china.jpg@300+resize_0.25': '2680bfa0a079ab960c177424',
    'astronaut.png+reverse_crop_10_left_q90': '9ffbe169d36d95a41f8e130b',
    'china.jpg@300+reverse_crop_10_left_q90': '1f7a5e2f097e89b8e73faa55',
    'astronaut.png+reverse_crop_10_bottom_q90': '9f24c63055ae226c371e3a98',
    'china.jpg@300+reverse_crop_10_bottom_q90': 'b7e6f1dc5e0714b619973d93',
    'astronaut.png+gray_jpeg_q30_half': 'ca91eaed1f4126e3547b466a',
    'china.jpg@300+gray_jpeg_q30_half': '713cc218307fca3671f99a10',
    'astronaut.png+brightness_1.2': '4116bc192b69d1f77c28796d',
    'china.jpg@300+brightness_1.2': 'a09f48a75c3bc37a469d703b',
    'camera.png@x1.4+border_10_white': '35c28a4157fb984f19d52f52',
    'moon.png+border_10_black': '42810ec35eb768c6b1d1ef7b',
    'coffee.png@120+border_10_white': 'bc5e011e7603d1fe87fcf20b',
    'flat_grey': 'df2516583ca0325ec70053c7',
    'gradient': '34b8094a44fdfd51df5f6939',
    'stripes': '7ee8773e31dfa742c4d63e94',
    'noise': '93430e4f45caa4b238b40552',
    'rgba': '35efad0e03bb6e9c66863a98',
    'palette': 'ae59eb4e875ebffd9897fd9a',
    'strip': 'c53ad8c4447c31c01522a5ee',
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_signatures_are_bit_identical_to_version_6_as_recorded(name):
    assert _digest(_case(name)) == PINNED[name], (
        f"{name}: neardup.signatures now computes other bits than signature version 6 recorded; "
        "a speed-up must not move a bit (else bump SIGNATURE_VERSION and recalibrate)")
