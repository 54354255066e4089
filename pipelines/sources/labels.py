"""Labels for a flat folder of images, or a flat tar of them, from a label file (``--labels``), as
ImageNet's validation set ships.

Two forms:

* ``LOC_val_solution.csv`` (Kaggle): ``ImageId,PredictionString`` rows, the string
  ``"wnid x y x y ..."``; an image's label is its first WNID. Rows match files by name without
  the extension.
* the devkit's ``ILSVRC2012_validation_ground_truth.txt``: one 1-based ILSVRC id per line, in
  the sorted order of the folder's file names, with ``--synsets`` to name the ids: a list of
  WNIDs in id order (``LOC_synset_mapping.txt``'s first column), or the devkit's ``meta.mat``.

Only items without a label are labelled: files directly under the input, and the members of an
archive that sit in no class folder (``ILSVRC2012_img_val.tar``); the class ids then follow the
default sorted names.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import posixpath

import fsspec

from pipelines.sources import tar
from pipelines.sources.base import SourceError, Unit


def _read_text(path: str, flag: str) -> str:
    try:
        with fsspec.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise SourceError(f"{flag}: {path} not found; pass an existing label file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"{flag}: {path} cannot be read ({type(exc).__name__}: {exc})") from None


def _solution_csv(text: str, path: str) -> dict[str, str]:
    rows = csv.DictReader(io.StringIO(text))
    if not {"ImageId", "PredictionString"} <= set(rows.fieldnames or ()):
        raise SourceError(f"labels: {path} has columns {rows.fieldnames}, not ImageId,PredictionString; pass "
                          "LOC_val_solution.csv or the devkit's ground-truth file with --synsets")
    out = {}
    for n, row in enumerate(rows, 2):
        words = (row.get("PredictionString") or "").split()
        if not words:
            raise SourceError(f"labels: {path}:{n}: {row.get('ImageId')} has an empty PredictionString")
        out[row["ImageId"]] = words[0]
    return out


def read_synsets(path: str) -> list[str]:
    """The WNIDs in ILSVRC id order (id 1 first): from a list file (first word a line) or the devkit's ``meta.mat``."""
    if path.lower().endswith(".mat"):
        import scipy.io

        try:
            with fsspec.open(path, "rb") as f:
                synsets = scipy.io.loadmat(f, squeeze_me=True)["synsets"]
            # The 1,000 classes are the leaves of its 1,860 synsets, ids 1..1000 (as torchvision reads it).
            leaves = sorted((int(s["ILSVRC2012_ID"]), str(s["WNID"])) for s in synsets if int(s["num_children"]) == 0)
        except (OSError, KeyError, ValueError, TypeError, IndexError) as exc:
            raise SourceError(f"synsets: {path} is not the devkit's meta.mat ({type(exc).__name__}: {exc}); "
                              "pass it or a file of WNIDs, one a line in id order") from None
        return [wnid for _, wnid in leaves]
    names = [line.split()[0] for line in _read_text(path, "synsets").splitlines() if line.strip()]
    if not names:
        raise SourceError(f"synsets: {path} is empty; pass a file of WNIDs, one a line in id order")
    return names


def _ground_truth(text: str, path: str, synsets: list[str], files: list[str]) -> dict[str, str]:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) != len(files):
        raise SourceError(f"labels: {path} has {len(lines)} lines but the input has {len(files)} unlabelled "
                          "files; its line i labels the i-th file in sorted name order, so the counts must match")
    out = {}
    for n, (line, name) in enumerate(zip(lines, sorted(files)), 1):
        if not line.isdigit() or not 1 <= int(line) <= len(synsets):
            raise SourceError(f"labels: {path}:{n}: {line!r} is not an id in 1..{len(synsets)} of --synsets")
        out[name] = synsets[int(line) - 1]
    return out


def _stem(uri: str) -> str:
    return posixpath.splitext(posixpath.basename(uri))[0]


def _tar_members(units: list[Unit]) -> dict[str, list[str]]:
    """``{archive url: its members in no class folder}`` of the archives not inside a class folder."""
    return {u.uris[0]: tar.unlabelled_members(u.uris[0]) for u in units
            if u.kind == tar.READER.name and u.error is None and not u.labels[0]}


def _by_name(text: str, labels: str, synsets: str | None, stems: list[str]) -> dict[str, str]:
    if text.lstrip().split(",", 1)[0].strip().lstrip("\ufeff") == "ImageId":
        return _solution_csv(text, labels)
    if synsets is None:
        raise SourceError(f"labels: {labels} is not LOC_val_solution.csv; a ground-truth file of ids needs "
                          "--synsets (the devkit's meta.mat or a WNID list)")
    return _ground_truth(text, labels, read_synsets(synsets), stems)


def _labelled(u: Unit, by_name: dict[str, str], members: dict[str, list[str]]) -> Unit:
    if u.error is None and u.kind == "files":
        return dataclasses.replace(u, labels=tuple(lab or (by_name[_stem(uri)],) for uri, lab in zip(u.uris, u.labels)))
    if u.error is None and members.get(u.uris[0]):
        return tar.with_file_labels(u, {tar.file_stem(m): by_name[tar.file_stem(m)] for m in members[u.uris[0]]})
    return u


def label_files(units: list[Unit], labels: str, synsets: str | None) -> list[Unit]:
    """``units`` with every unlabelled file, and every archive member in no class folder, labelled
    from ``labels``; a SourceError when one has no label there or the file cannot be used."""
    # (where, file stem) of each: a member's stem is its own name's, not its archive's.
    unlabelled = [(uri, _stem(uri)) for u in units if u.kind == "files" and u.error is None
                  for uri, lab in zip(u.uris, u.labels) if not lab]
    members = _tar_members(units)
    unlabelled += [(f"tar://{m}::{url}", tar.file_stem(m)) for url, names in members.items() for m in names]
    by_name = _by_name(_read_text(labels, "labels"), labels, synsets, [stem for _, stem in unlabelled])
    missing = [uri for uri, stem in unlabelled if stem not in by_name]
    if missing:
        raise SourceError(f"labels: {len(missing)} of {len(unlabelled)} unlabelled files have no label in {labels}, "
                          f"e.g. {missing[0]}; pass the label file of this input")
    return [_labelled(u, by_name, members) for u in units]
