"""Test-set registry: a name maps to a source, and a source yields decoded images or reasons.

A source is anything the ingest accepts (``pipelines.sources.iter_items``, shard
sets included), decoded by ``pipelines.decode.decode_image`` so that a test image
and its corpus copy go through the same pixels path.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from PIL import Image


@dataclasses.dataclass
class Item:
    key: str
    uri: str
    image: Image.Image | None
    error: tuple[str, str] | None  # (reason, detail) when the image is quarantined


def parse_test_sets(specs: list[str]) -> dict[str, str]:
    """``["cifar10=gs://b/cifar", ...]`` -> ``{"cifar10": "gs://b/cifar"}``, with errors that name the spec."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, source = spec.partition("=")
        name, source = name.strip(), source.strip()
        if not sep or not name or not source:
            raise ValueError(f"--test-set {spec!r}: expected name=source, e.g. cifar10=/data/cifar10/test")
        if name in out and out[name] != source:
            raise ValueError(f"--test-set {spec!r}: test set {name!r} already maps to {out[name]!r}")
        out[name] = source
    return out


def iter_images(source: str) -> Iterator[Item]:
    """Every image of ``source``, decoded to 8-bit RGB exactly as the ingest decodes it, or its rejection reason.

    Any source the ingest accepts works, shard sets included (``pipelines.sources``
    owns source kinds); an unreadable item or undecodable image becomes an
    ``Item`` with ``error=(reason, detail)`` so a bad test image is quarantined.
    """
    from pipelines.decode import BadImage, decode_image
    from pipelines.sources import iter_items

    for raw in iter_items(source):
        try:
            img = decode_image(raw.read(), uri=raw.uri)
        except BadImage as exc:
            yield Item(raw.key, raw.uri, None, (exc.reason, exc.detail))
        else:
            yield Item(raw.key, raw.uri, img, None)
