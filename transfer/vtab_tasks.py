"""The VTAB-1k task registry: the 19 tasks in their 3 groups (Zhai et al. 2019, VTAB-1k).

Each task carries its class count, how its label is defined from the TFDS features, the splits
its 1k version is cut from, and the augmentations that would change its label (BiT, Appendix F:
no horizontal flip where left and right matter, no random crop where the whole scene or the
position does). A task folder (``DIR/<task>``) holds three shard sets: ``train800/``
(``train[:800]``), ``val200/`` (the first 200 of the task's validation split) and ``test/``;
jobs/vtab_prepare.py writes them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from training.task_folders import SPLITS  # noqa: F401 (the task folder's layout; re-exported)

GROUPS = ("natural", "specialized", "structured")
TRAIN_SIZE, VAL_SIZE = 800, 200


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    group: str
    num_classes: int | None  # None: read from the task's shard sets (a user's own task)
    label: str  # how the label is defined
    flip: bool = True
    crop: bool = True
    tfds: str | None = None  # TFDS builder name (with config and version)
    train_split: str = "train"  # TFDS splits the 1k version is cut from
    val_split: str = "validation"
    test_split: str = "test"
    label_fn: Callable[[Mapping[str, Any]], int] | None = dataclasses.field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict:
        return {"name": self.name, "group": self.group, "num_classes": self.num_classes, "label": self.label,
                "flip": self.flip, "crop": self.crop}


def _feature(key: str) -> Callable[[Mapping[str, Any]], int]:
    return lambda ex: int(ex[key])


def _binned(key: str, original: int, classes: int = 16) -> Callable[[Mapping[str, Any]], int]:
    # dSprites: label = floor(value / (original classes / 16)).
    return lambda ex: int(np.floor(int(ex[key]) / (original / classes)))


CLEVR_DISTANCE_THRESHOLDS = [0.0, 8.0, 8.5, 9.0, 9.5, 10.0, 100.0]
KITTI_DISTANCE_THRESHOLDS = [-100.0, 8.0, 20.0, 999.0]
KITTI_VEHICLE_TYPES = (0, 1, 2)  # TFDS kitti object types Car, Van, Truck


def clevr_count(ex: Mapping[str, Any]) -> int:
    """Number of objects − 3 (CLEVR scenes hold 3 to 10 objects)."""
    return len(ex["objects"]["size"]) - 3


def clevr_distance(ex: Mapping[str, Any]) -> int:
    """The closest object's depth, binned at [0, 8, 8.5, 9, 9.5, 10, 100]."""
    depth = float(np.min(np.asarray(ex["objects"]["pixel_coords"])[:, 2]))
    return int(np.clip(np.searchsorted(CLEVR_DISTANCE_THRESHOLDS, depth, side="right") - 1, 0, 5))


def kitti_distance(ex: Mapping[str, Any]) -> int:
    """The closest vehicle's z binned at [−100, 8, 20, 999]; class 3 when there is no vehicle."""
    objects = ex["objects"]
    types = np.asarray(objects["type"])
    z = np.asarray(objects["location"]).reshape(-1, 3)[:, 2][np.isin(types, KITTI_VEHICLE_TYPES)]
    if z.size == 0:
        return 3
    return int(np.clip(np.searchsorted(KITTI_DISTANCE_THRESHOLDS, float(z.min()), side="right") - 1, 0, 2))


def _t(name, group, classes, label, *, tfds, flip=True, crop=True, train="train", val="validation", test="test",
       fn=None) -> Task:
    return Task(name, group, classes, label, flip=flip, crop=crop, tfds=tfds, train_split=train, val_split=val,
                test_split=test, label_fn=fn or _feature("label"))


TASKS: dict[str, Task] = {t.name: t for t in (
    _t("caltech101", "natural", 102, "label", tfds="caltech101:3.*.*", train="train[:2754]", val="train[2754:]"),
    _t("cifar100", "natural", 100, "label", tfds="cifar100:3.*.*", train="train[:45000]", val="train[45000:]"),
    _t("dtd", "natural", 47, "label", tfds="dtd:3.*.*"),
    _t("flowers102", "natural", 102, "label", tfds="oxford_flowers102:2.*.*"),
    _t("pets", "natural", 37, "label", tfds="oxford_iiit_pet:3.*.*", train="train[:2944]", val="train[2944:]"),
    _t("svhn", "natural", 10, "label", tfds="svhn_cropped:3.*.*", train="train[:65931]", val="train[65931:]"),
    _t("sun397", "natural", 397, "label", tfds="sun397/tfds:4.*.*"),
    _t("patch_camelyon", "specialized", 2, "label", tfds="patch_camelyon:2.*.*"),
    _t("eurosat", "specialized", 10, "label", tfds="eurosat/rgb:2.*.*", train="train[:16200]",
       val="train[16200:19440]", test="train[21600:]"),
    _t("resisc45", "specialized", 45, "label", tfds="resisc45:3.*.*", train="train[:18900]",
       val="train[18900:25200]", test="train[25200:]"),
    _t("retinopathy", "specialized", 5, "label (btgraham-300 preprocessing)",
       tfds="diabetic_retinopathy_detection/btgraham-300:3.*.*"),
    _t("clevr_count", "structured", 8, "number of objects - 3", tfds="clevr:3.*.*", crop=False,
       train="train[:63000]", val="train[63000:]", test="validation", fn=clevr_count),
    _t("clevr_distance", "structured", 6, "closest object's depth binned at [0, 8, 8.5, 9, 9.5, 10, 100]",
       tfds="clevr:3.*.*", crop=False, train="train[:63000]", val="train[63000:]", test="validation",
       fn=clevr_distance),
    _t("dmlab", "structured", 6, "label", tfds="dmlab:2.*.*", crop=False),
    _t("kitti_distance", "structured", 4, "closest vehicle's z binned at [-100, 8, 20, 999]; 3: no vehicle",
       tfds="kitti:3.*.*", crop=False, fn=kitti_distance),
    _t("dsprites_location", "structured", 16, "floor(x position / (32 / 16))", tfds="dsprites:2.*.*",
       flip=False, crop=False, train="train[:589824]", val="train[589824:663552]", test="train[663552:]",
       fn=_binned("label_x_position", 32)),
    _t("dsprites_orientation", "structured", 16, "floor(orientation / (40 / 16))", tfds="dsprites:2.*.*",
       flip=False, train="train[:589824]", val="train[589824:663552]", test="train[663552:]",
       fn=_binned("label_orientation", 40)),
    _t("smallnorb_azimuth", "structured", 18, "label_azimuth", tfds="smallnorb:2.*.*", flip=False,
       val="test[:50%]", test="test[50%:]", fn=_feature("label_azimuth")),
    _t("smallnorb_elevation", "structured", 9, "label_elevation", tfds="smallnorb:2.*.*",
       val="test[:50%]", test="test[50%:]", fn=_feature("label_elevation")),
)}


def custom_task(group: str, name: str, *, flip: bool = True, crop: bool = True) -> Task:
    """A user's own task in one of the three groups; its classes come from its shard sets."""
    return Task(name, group, None, "the shard set's labels", flip=flip, crop=crop)
