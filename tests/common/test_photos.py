"""common.photos: the bundled photographs, by name, without a network."""
import numpy as np
import pytest

from common.photos import ALL, SKLEARN, photo, photos


def test_every_listed_photograph_loads_as_rgb_and_sklearns_too():
    loaded = photos(ALL, max_side=64)
    assert list(loaded) == list(ALL) and set(SKLEARN) <= set(loaded)
    assert all(img.mode == "RGB" and max(img.size) == 64 for img in loaded.values())
    # Distinct photographs, not one file under many names.
    assert len({np.asarray(img.resize((8, 8))).tobytes() for img in loaded.values()}) == len(ALL)


def test_a_file_keeps_its_mode_on_request_and_a_wrong_name_is_named():
    assert photo("camera.png", mode=None).mode == "L"
    with pytest.raises(FileNotFoundError, match="no_such.png: not in scikit-image's data folder"):
        photo("no_such.png")
