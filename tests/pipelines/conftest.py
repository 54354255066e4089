"""Real images, real files, a real MLflow store and the real Beam DirectRunner."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.pipelines.imagefiles import encode, write

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _pipeline_runs_log_to_a_throwaway_store(mlflow_store):
    """Every pipelines test runs stages that log: all of them go to the suite's ``mlflow_store``."""
    return mlflow_store


@pytest.fixture(scope="session")
def photos() -> dict[str, Image.Image]:
    """Real photographs by stem ("chelsea"), shrunk so that pipeline tests stay fast; camera stays mode L."""
    from common.photos import SKLEARN, photo

    names = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "retina.jpg", "hubble_deep_field.jpg")
    out = {Path(n).stem: photo(n, max_side=160) for n in names}
    out["camera"] = photo("camera.png", mode=None, max_side=160)
    out.update({Path(n).stem: photo(n, max_side=160) for n in SKLEARN})
    return out


@pytest.fixture
def enc():
    return encode


@pytest.fixture
def wr():
    return write


@pytest.fixture(scope="session")
def noisy_copies():
    """``noisy_copies(root, photos, n, ...)``: see :func:`write_noisy_copies`."""
    return write_noisy_copies


def run_prepare_cfg(**kwargs):
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    kwargs.setdefault("workers", 1)
    return run_prepare(PrepareConfig(**kwargs))


@pytest.fixture(scope="session")
def prepare():
    """``prepare(input=[...], output=..., **cfg)`` -> manifest, through the real pipeline."""
    return run_prepare_cfg


def write_noisy_copies(root: Path, photos: dict[str, Image.Image], n: int, *, classes: int, class_prefix: str,
                       spread: int, seed: int, size: tuple[int, int] | None = None) -> Path:
    """``n`` distinct PNGs under ``root/<class_prefix><i % classes>/``: the photos in turn, with uniform noise."""
    rng = np.random.default_rng(seed)
    names = sorted(photos)
    for i in range(n):
        img = photos[names[i % len(names)]].convert("RGB")
        base = np.asarray(img.resize(size) if size else img, np.int16)
        arr = np.clip(base + rng.integers(-spread, spread, base.shape), 0, 255).astype(np.uint8)
        path = root / f"{class_prefix}{i % classes}" / f"{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(arr).save(path, "PNG")
    return root


def pixels(img: Image.Image) -> np.ndarray:
    return np.asarray(img.convert("RGB"))
