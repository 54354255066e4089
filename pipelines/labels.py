"""Label ids: the order of the names a corpus gives, and the name an integer label stands for.

WebDataset ``.cls`` files, Hugging Face ``ClassLabel`` columns and many manifests label images
with class ids. Sorted as text they would be permuted (``10`` before ``2``), so names that are all
integers are ordered by value. With a label map of names (``--label-map``), an integer label that
is not itself a name in it is the id of one: ``7`` is the class whose id is 7.
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping

_INT = re.compile(r"-?\d+")


def default_label_map(names: Iterable[str]) -> dict[str, int]:
    """Ids for the names seen in a corpus: sorted, by value when every name is an integer."""
    ordered = sorted(set(names))
    if ordered and all(_INT.fullmatch(n) for n in ordered):
        ordered.sort(key=int)
    return {n: i for i, n in enumerate(ordered)}


def names_by_id(label_map: Mapping[str, int]) -> dict[str, str]:
    """``{"7": name}`` for each id of ``label_map``: how an integer label finds its name."""
    return {str(i): name for name, i in label_map.items()}


def resolve(labels: tuple[str, ...], label_map: Mapping[str, int], by_id: Mapping[str, str]) -> tuple[str, ...]:
    """``labels`` with each integer that is not a name of ``label_map`` replaced by the name of that id."""
    return tuple(by_id.get(str(int(n)), n) if n not in label_map and _INT.fullmatch(n) else n for n in labels)


def renumbered(label_map: Mapping[str, int]) -> list[str]:
    """The integer names of a default label map whose id is not their value (a class id with no images before them)."""
    if not label_map or not all(_INT.fullmatch(n) for n in label_map):
        return []
    return [n for n, i in sorted(label_map.items(), key=lambda kv: kv[1]) if int(n) != i]
