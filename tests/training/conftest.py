"""Shared fixtures of the transfer tests: generated VTAB-style task folders and a tiny pre-trained ViT."""
from __future__ import annotations

from pathlib import Path

import pytest


def make_task_dirs(root: Path, names: list[str] | None = None, *, train: int, test: int, size: int = 32,
                   **split_sizes) -> dict[str, Path]:
    """The demo's generated tasks (digits, textures, count) through the folders converter into ``root``.

    ``names`` picks some of them; ``split_sizes`` are the converter's ``train_size``/``val_size``.
    """
    from demo.data import build_vtab_tasks
    from training.vtab_data import VtabPrepareConfig, run_vtab_prepare

    mp = pytest.MonkeyPatch()
    mp.setenv("VITSCALE_HOME", str(root / "mlruns-prepare"))
    try:
        raw = build_vtab_tasks(root / "raw", train=train, test=test, size=size)
        out = {}
        for name in names or list(raw):
            run_vtab_prepare(VtabPrepareConfig(source="folders", input=str(raw[name]), output=str(root / name),
                                               size=size, **split_sizes))
            out[name] = root / name
    finally:
        mp.undo()
    return out


def make_pretrained(path: Path, *, img_size: int, representation_size: int) -> Path:
    """A 2-block Ti/8 with a representation layer, saved as vitcore's checkpoint format."""
    import torch

    import vitcore

    torch.manual_seed(0)
    model = vitcore.create_model("Ti/8", num_classes=7, img_size=img_size, depth=2,
                                 representation_size=representation_size)
    vitcore.save_checkpoint(model, path)
    return path


@pytest.fixture(scope="session")
def build_task_dirs():
    return make_task_dirs


@pytest.fixture(scope="session")
def build_pretrained():
    return make_pretrained
