"""Writing test inputs: an image encoded in a format, and bytes at a path whose folders are made."""
from __future__ import annotations

import io
from pathlib import Path

from PIL import Image


def encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path
