import pytest

from dedup.calibration import photo_pool


@pytest.fixture(scope="session")
def pool():
    return photo_pool()


@pytest.fixture(scope="session")
def photos(pool):
    """Whole photographs (not tiles), by name."""
    return {name: img for name, img in pool if "@" not in name}


@pytest.fixture(scope="session")
def tiles(pool):
    return [img for name, img in pool if "@" in name]

