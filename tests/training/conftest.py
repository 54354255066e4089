"""Fixtures shared by the pre-training tests."""
import numpy as np
import pytest


@pytest.fixture(scope="module")
def photo_shards(tmp_path_factory, mlflow_store, ray_session):
    """Crops of real photos in three classes, stored as JPEG shards with a 64 px shorter side."""
    from common.photos import photo
    from demo.data import random_crop
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for name in ("chelsea.png", "coffee.png", "astronaut.png"):
        folder = root / "src" / name.split(".")[0]
        folder.mkdir(parents=True)
        base = photo(name, max_side=200)
        for i in range(10):
            random_crop(base, 96, rng).save(folder / f"{i}.jpg", quality=90)
    run_prepare(PrepareConfig(input=[str(root / "src")], output=str(root / "shards"), size=64, workers=1))
    return str(root / "shards")
