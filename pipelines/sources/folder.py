"""An image folder tree: every file under the root is an item, its class the first-level sub-folder.

``train/n01440764/x.JPEG`` -> ``n01440764`` (the ImageNet layout); files directly under the root
have no label. Hidden files and folders (``.DS_Store``, ``._x.jpg``) are skipped. Any other file
is an item, so a stray ``README.txt`` is quarantined as ``not_an_image`` rather than silently
ignored. Tar archives in the tree are read as archives (:mod:`pipelines.sources.tar`), and a tar
of per-class tars as ImageNet's train archive (:mod:`pipelines.sources.imagenet`).
"""
from __future__ import annotations

import os

from common.fs import is_local
from pipelines.sources import imagenet, tar
from pipelines.sources.base import FileBatcher, Reader, Unit, is_hidden


def _local_tree_files(root: str) -> list[str]:
    """Every file under a local ``root``, through symlinked folders, each folder walked once.

    fsspec's ``find`` lists a symlinked class folder as one file, which then fails to read.
    A link back to a folder already walked (a loop) is skipped.
    """
    seen: set[tuple[int, int]] = set()
    files = []
    for top, dirs, names in os.walk(root, followlinks=True):
        st = os.stat(top)
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        files.extend(f"{top}/{name}" for name in names)
    return files


def _plan(source: str, fs, root: str, files_per_unit: int, options=None) -> list[Unit]:
    units: list[Unit] = []
    files = FileBatcher(units, files_per_unit)
    for path in sorted(_local_tree_files(root) if is_local(fs) else fs.find(root, withdirs=False)):
        rel = path[len(root):].lstrip("/")
        if not rel or is_hidden(rel):
            continue
        parts = rel.split("/")
        labels = (parts[0],) if len(parts) > 1 else ()
        url = fs.unstrip_protocol(path)
        if tar.is_tar(path):
            # ImageNet's train archive in a folder is a tar of class tars, not a class of its own.
            units.extend(imagenet.READER.plan(url, fs, path, files_per_unit) if imagenet.READER.detect(fs, path)
                         else [tar.unit(url, path, labels)])
            continue
        files.add(url, labels)
    files.flush()
    return units


READER = Reader("folder", detect=lambda fs, path: fs.isdir(path), plan=_plan)
