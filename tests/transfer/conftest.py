"""Shared fixtures of the transfer tests: generated VTAB-style task folders (the tiny pre-trained ViT
is in tests/conftest.py: the pre-training interrupt tests use it too)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import new_home


def make_task_dirs(root: Path, names: list[str] | None = None, *, train: int, test: int, size: int = 32,
                   **split_sizes) -> dict[str, Path]:
    """The demo's generated tasks (digits, textures, count) through the folders converter into ``root``.

    ``names`` picks some of them; ``split_sizes`` are the converter's ``train_size``/``val_size``.
    """
    from demo.data import build_vtab_tasks
    from transfer.vtab_data import VtabPrepareConfig, run_vtab_prepare

    mp = pytest.MonkeyPatch()
    mp.setenv("VITSCALE_HOME", str(new_home(root / "mlruns-prepare")))
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


def packed_label_map(task_dir: Path) -> dict[str, int]:
    """``{class folder: label id}`` as packed into the task's train800 rows: each row's id beside the
    name of the folder its image came from."""
    from pipelines.schema import ShardSet

    rows = ShardSet(Path(task_dir) / "train800")
    return {Path(rows[i]["source"]).parent.name: rows[i]["labels"][0] for i in range(len(rows))}


@pytest.fixture(scope="session")
def build_task_dirs():
    return make_task_dirs
