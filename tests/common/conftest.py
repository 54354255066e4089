"""Fixtures for the base layer's tests."""
from __future__ import annotations

import os
import subprocess

import pytest


def _mount_read_only(target) -> bool:
    target.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(target)], capture_output=True)
    if r.returncode != 0:
        return False
    (target / "out").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(target)], check=True, capture_output=True)
    return True


@pytest.fixture
def read_only_folder(tmp_path):
    mnt = tmp_path / "ro"
    if os.geteuid() != 0 or not _mount_read_only(mnt):
        pytest.skip("mounting a read-only tmpfs needs root (mount -t tmpfs); not available here")
    yield mnt / "out"
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
