"""The real photographs bundled with scikit-image and scikit-learn: the one loader of them.

The demo, the dedup calibration, the benchmarks and the test fixtures draw their real
images from here. Nothing is downloaded: the files ship inside the two wheels.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from PIL import Image

# scikit-learn's two sample photographs; every other name is a file of skimage's data folder.
SKLEARN = ("china.jpg", "flower.jpg")

# The colour and grey photographs (not the synthetic or microscopy test patterns) of skimage's data folder.
SKIMAGE = ("astronaut.png", "chelsea.png", "coffee.png", "camera.png", "hubble_deep_field.jpg", "retina.jpg",
           "rocket.jpg", "motorcycle_left.png", "brick.png", "grass.png", "gravel.png", "coins.png", "moon.png",
           "cell.png", "ihc.png", "clock_motion.png")

ALL = SKIMAGE + SKLEARN


def skimage_path(name: str) -> Path:
    """The file ``name`` in scikit-image's data folder, as shipped (for tests of its exact bytes)."""
    import skimage

    path = Path(os.path.dirname(skimage.__file__)) / "data" / name
    if not path.is_file():
        raise FileNotFoundError(f"{name}: not in scikit-image's data folder ({path.parent})")
    return path


def photo(name: str, *, mode: str | None = "RGB", max_side: int | None = None) -> Image.Image:
    """One photograph by file name (``"chelsea.png"``, ``"china.jpg"``, ...).

    ``mode`` converts it (``None`` keeps the file's own mode, e.g. ``"L"`` for camera.png);
    ``max_side`` shrinks it to fit that square, keeping the aspect ratio.
    """
    if name in SKLEARN:
        from sklearn.datasets import load_sample_image

        img = Image.fromarray(load_sample_image(name))
    else:
        img = Image.open(skimage_path(name))
        img.load()
    if mode is not None and img.mode != mode:
        img = img.convert(mode)
    if max_side is not None:
        img.thumbnail((max_side, max_side))
    return img


def photos(names: Iterable[str] = ALL, *, mode: str | None = "RGB",
           max_side: int | None = None) -> dict[str, Image.Image]:
    """``{name: photo(name)}`` in the order given."""
    return {name: photo(name, mode=mode, max_side=max_side) for name in names}


CROP_CLASSES = (("cat", "chelsea.png"), ("coffee", "coffee.png"))


def crop_folder(root: Path, per_class: int = 8, classes: Iterable[tuple[str, str]] = CROP_CLASSES) -> Path:
    """A small labelled folder in ``root``: ``per_class`` 200 px crops of each class's photograph
    (chelsea.png as ``cat``, coffee.png as ``coffee``), as PNG. The tiny corpus of the test suite
    and benchmarks."""
    for cls, name in classes:
        (root / cls).mkdir(parents=True, exist_ok=True)
        img = photo(name)
        for i in range(per_class):
            img.crop((i * 20, i * 10, i * 20 + 200, i * 10 + 200)).save(root / cls / f"{i}.png")
    return root
