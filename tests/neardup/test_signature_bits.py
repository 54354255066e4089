"""Every output of neardup.signatures, pinned bit for bit on a spread of images.

Stored test-set indexes, incremental dedup state and the calibration hold these bits; a
change that only makes the code faster must reproduce them exactly (a change that moves
them needs a new SIGNATURE_VERSION and a fresh calibration). The digests were recorded
with signature version 7 as first merged, and must be the same on every CPU: the DCT runs
on whole numbers, which any BLAS kernel sums exactly. Version 6 let OpenBLAS round it, and
its kernel (AVX-512, AVX2 or SSE, picked per CPU) moved every texture margin and the bits of
near-ties; the last test here runs two of those kernels on one machine.
"""
import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

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


# name -> digest, as signature version 7 computes them on any CPU
PINNED = {
    'astronaut.png': 'a0486ec4b2ff27428799c046',
    'astronaut.png@200': '076873905987d285a843ebcb',
    'astronaut.png@64': 'b1c36b004f8fcfa5453d9c89',
    'camera.png': 'f38d43d8c9dbb2111022c9e6',
    'camera.png@200': 'a68e568b9508c07f8d368d82',
    'camera.png@64': '73eaaf06aa6e87c44e330526',
    'china.jpg': 'fedaa94d24080c9c8dc9bb04',
    'china.jpg@200': '1a22d45e9c515b2fbb19046c',
    'china.jpg@64': '612c64873a90c3215582a5ef',
    'coffee.png': '9ec48c99ac5d27a4b61910bc',
    'coffee.png@200': '69d12326e111351169ac894b',
    'coffee.png@64': 'b2d5f247d8fe208ef3857da0',
    'brick.png': '43b18697002dbd412b08a5e0',
    'brick.png@200': '76dd04608765c9e49f92cbe6',
    'brick.png@64': 'cb72e4e5d5e33efda6b455bd',
    'moon.png': '54b06ccd349c79487cf5d2dc',
    'moon.png@200': 'c68fc2f7531031ed94476c89',
    'moon.png@64': 'b48070bfe8b916a27e89de5f',
    'rocket.jpg': '16af57f71e7c8a6b029f5fb3',
    'rocket.jpg@200': 'a3039e319a286cbdf1608dfd',
    'rocket.jpg@64': '21c75a9603144c25d713d04f',
    'flower.jpg': 'bf899959a334217abdd9a082',
    'flower.jpg@200': 'aab276b84557c3eed02b5751',
    'flower.jpg@64': '628693fde4870e9265fc16ad',
    'china.jpg@400': '3603b002fdd5d883f8b2357e',
    'astronaut.png@x5': 'f83bcbea7c16c04d135e2344',
    'astronaut.png@x1.4': '833e82227470aa2342721294',
    'chelsea.png@x2': 'd16156157af7d35ce4872a47',
    'hubble_deep_field.jpg': '2082c2f9164a9a7c07aef337',
    'coins.png@300': '24bf4ed90cb2ef0e1b66a1d0',
    'astronaut.png+border_10_white': '5e510dc8b1ebc9208994f162',
    'china.jpg@300+border_10_white': '934f8fd6bbb1fc36f170210e',
    'astronaut.png+border_10_black': '18c140af5487099f28328091',
    'china.jpg@300+border_10_black': 'dc307e4dcc6941c69ccbd237',
    'astronaut.png+border_5_color': 'e333304795fb632cfc328b20',
    'china.jpg@300+border_5_color': '083309c5b690aaa8dfab2989',
    'astronaut.png+crop_10_all': 'b2198a80158986851e0c6735',
    'china.jpg@300+crop_10_all': 'a2fb2f284d8dd09dc748c540',
    'astronaut.png+crop_random': 'f9899a45bf090b0c52e01703',
    'china.jpg@300+crop_random': 'be0da16977c45a7fc0b6670e',
    'astronaut.png+grayscale': 'a0486ec4b2ff27428799c046',
    'china.jpg@300+grayscale': '78eda91f07707b6b9dc9eb33',
    'astronaut.png+jpeg_q30': '8dc09a9115d8f9f03eb81e9a',
    'china.jpg@300+jpeg_q30': '06858f753ccf56923fa5e0de',
    'astronaut.png+resize_0.25': 'e64c7d2cbb9a18bffd1803d4',
    'china.jpg@300+resize_0.25': '25169cf54c95e0f24109efeb',
    'astronaut.png+reverse_crop_10_left_q90': 'c4cecf363443277ce905b672',
    'china.jpg@300+reverse_crop_10_left_q90': '9cc900f1e800cc4211782d97',
    'astronaut.png+reverse_crop_10_bottom_q90': '5d1c010cc6efa2f00c48cc03',
    'china.jpg@300+reverse_crop_10_bottom_q90': '726b98253cff37dea26f66a7',
    'astronaut.png+gray_jpeg_q30_half': 'a732cead54fc5fdebf7b2da3',
    'china.jpg@300+gray_jpeg_q30_half': 'ca8200f4db5492010a7245fb',
    'astronaut.png+brightness_1.2': '5407fe629011338a6e9f736f',
    'china.jpg@300+brightness_1.2': '9b75dbcdf4148fda8b0c6ca5',
    'camera.png@x1.4+border_10_white': '1a2301fa25acc61665dc4f1b',
    'moon.png+border_10_black': 'ce6a430f48af8f579970fd80',
    'coffee.png@120+border_10_white': 'b29620c871d0ffefe674d6e3',
    'flat_grey': 'ee563e63b1e58d2ea3f9969e',
    'gradient': 'd50e26fd9ffc02efd6fd065c',
    'stripes': '2a81b242d17bb9c0dcbbd1e5',
    'noise': '7712641d63ec9052eda876ba',
    'rgba': '8c5049c25c7f86196e059b28',
    'palette': '3e407b671a206bdf1854774e',
    'strip': '796792cf788af814dca1950c',
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_signatures_are_bit_identical_to_version_7_as_recorded(name):
    assert _digest(_case(name)) == PINNED[name], (
        f"{name}: neardup.signatures now computes other bits than signature version 7 recorded; "
        "a speed-up must not move a bit (else bump SIGNATURE_VERSION and recalibrate)")


# A photo at proxy scales 1, 2 and 7, a frame, a crop, and images whose coefficients are
# mostly zero, so that their bits and margins are all rounding.
_KERNEL_CASES = ("astronaut.png@64", "china.jpg@200", "astronaut.png", "astronaut.png+border_10_white",
                 "china.jpg@300+crop_random", "stripes", "gradient")
_KERNEL_SCRIPT = """
import json, sys
import threadpoolctl
sys.path.insert(0, sys.argv[1])
import test_signature_bits as t
arch = {i.get("architecture") for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"}
print(json.dumps({"kernel": sorted(map(str, arch)), "digests": {n: t._digest(t._case(n)) for n in sys.argv[2:]}}))
"""


def _digests_under(coretype: str | None) -> dict:
    """The BLAS kernel and the digests of ``_KERNEL_CASES`` in a fresh process, OpenBLAS's own choice if None."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    env.update(OPENBLAS_NUM_THREADS="1", **({"OPENBLAS_CORETYPE": coretype} if coretype else {}))
    out = subprocess.run([sys.executable, "-c", _KERNEL_SCRIPT, str(Path(__file__).parent), *_KERNEL_CASES],
                         env=env, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 OpenBLAS kernels")
def test_signatures_are_the_same_under_another_blas_kernel():
    # Prescott (SSE3) runs on every x86-64 CPU; the other process keeps the kernel OpenBLAS
    # picked for this CPU (Haswell, SkylakeX, Zen...), whose sums round in another order.
    native, sse = _digests_under(None), _digests_under("Prescott")
    assert native["kernel"] != sse["kernel"], f"OPENBLAS_CORETYPE=Prescott did not change the kernel: {sse}"
    assert native["digests"] == sse["digests"], (
        f"signatures differ between OpenBLAS kernels {native['kernel']} and {sse['kernel']}; "
        "the DCT must run on whole numbers (neardup.signatures._whole_numbers)")
