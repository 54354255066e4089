"""Text that every sink accepts: UTF-8, whatever the operating system handed over."""
from __future__ import annotations


def utf8_text(text: str) -> str:
    """``text`` as valid UTF-8: bytes of a file name that are not UTF-8 become ``\\xNN``.

    Python hands such names (Latin-1 or Shift JIS names from old archives and
    crawls) over as lone surrogates. Arrow strings, JSON readers, UTF-8 files
    and MLflow's store all refuse them. Valid text comes back unchanged.
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that stands for no byte (a JSON "\ud800" escape)
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
