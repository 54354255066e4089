"""common.fs: the one atomic-write helper, and output folders refused in one line."""
import os

import pytest

from common.config import ConfigError
from common.fs import TMP_MARKER, atomic_open, atomic_write, make_output_dir


def test_atomic_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    atomic_write(path, "old")
    atomic_write(path, b"new bytes")
    assert path.read_bytes() == b"new bytes"
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "manifest.json"
    atomic_write(path, "complete")
    with pytest.raises(RuntimeError):
        with atomic_open(path, mode="w") as f:
            f.write("half of a new")
            raise RuntimeError("the writer died")
    assert path.read_text() == "complete"
    assert not [n for n in os.listdir(tmp_path) if TMP_MARKER in n]


def test_make_output_dir_creates_the_folder_and_names_a_file_in_the_way(tmp_path):
    assert make_output_dir(tmp_path / "a" / "b") == (tmp_path / "a" / "b").resolve()
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=f"output: {tmp_path / 'f'} is an existing file; give a directory"):
        make_output_dir(tmp_path / "f")
    with pytest.raises(ConfigError, match=f"workdir: {tmp_path / 'f' / 'sub'} cannot be created, a parent is a file"):
        make_output_dir(tmp_path / "f" / "sub", "workdir")


def test_an_existing_output_folder_on_a_read_only_mount_is_refused_in_one_line(read_only_folder):
    with pytest.raises(ConfigError) as info:
        make_output_dir(read_only_folder)
    assert str(info.value) == f"output: {read_only_folder} is on a read-only file system; give a writable directory"
