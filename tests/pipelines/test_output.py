"""The output folder's writer lock on a filesystem without flock (fsspec's memory://, as an object store)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import fsspec
import pytest

from common.locks import FolderBusy
from pipelines.output import LOCK, OutputFolder


def test_a_second_writer_over_fsspec_is_refused_naming_the_holder():
    url = "memory://output-lock/held"
    fsspec.filesystem("memory").makedirs("/output-lock/held", exist_ok=True)
    with OutputFolder(url, ["/src"]):
        with pytest.raises(FolderBusy, match=f"another prepare run is writing there \\(pid {os.getpid()} on "):
            OutputFolder(url, ["/src"]).__enter__()
    assert not fsspec.filesystem("memory").exists(f"/output-lock/held/{LOCK}")  # released at the end
    with OutputFolder(url, ["/src"]):  # and free again
        pass


def test_a_lock_file_of_a_dead_process_on_this_host_is_taken_over():
    fs = fsspec.filesystem("memory")
    fs.makedirs("/output-lock/stale", exist_ok=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    fs.pipe(f"/output-lock/stale/{LOCK}", json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout)}).encode())
    with OutputFolder("memory://output-lock/stale", ["/src"]):
        assert json.loads(fs.cat(f"/output-lock/stale/{LOCK}"))["pid"] == os.getpid()


def test_a_lock_file_from_another_host_is_named_with_the_fix():
    fs = fsspec.filesystem("memory")
    fs.makedirs("/output-lock/remote", exist_ok=True)
    fs.pipe(f"/output-lock/remote/{LOCK}", json.dumps({"host": "node-7", "pid": 4242}).encode())
    with pytest.raises(FolderBusy, match=f"pid 4242 on node-7.*if that process is gone, delete .*{LOCK}"):
        OutputFolder("memory://output-lock/remote", ["/src"]).__enter__()


def test_a_signal_during_the_swap_is_handed_to_the_run_not_re_sent_into_its_clean_up(tmp_path):
    # Re-sent as the swap ended, it cut short the run's clean-up: staging and plan folders stayed,
    # and the MLflow run never got its tags, though the new set was whole.
    import signal

    class SignalledWhileWritten(dict):
        def items(self):
            os.kill(os.getpid(), signal.SIGINT)  # arrives inside the swap
            return super().items()

    (tmp_path / "staged").mkdir()
    (tmp_path / "staged" / "shard-00000.arrow").write_bytes(b"rows")
    out = tmp_path / "out"
    out.mkdir()
    manifest = {"sources": ["/src"], "shards": [{"path": "shard-00000.arrow", "sha256": "x"}]}
    with OutputFolder(str(out), ["/src"]) as folder:
        folder.swap(str(tmp_path / "staged"), manifest, SignalledWhileWritten({"quarantine.jsonl": b""}))
        assert folder.held_signal == signal.SIGINT
    assert json.loads((out / "manifest.json").read_text()) == manifest


def test_prepare_into_a_folder_another_stage_owns_is_refused_before_it_writes(tmp_path):
    from common.config import InputError
    from common.locks import claim_folder

    claim_folder(tmp_path, "finetune")
    with pytest.raises(InputError, match=r"belongs to a finetune run .* give this prepare run another --output"):
        OutputFolder(str(tmp_path), ["/src"]).__enter__()
    assert os.listdir(tmp_path) == [".vitscale-stage.json"]
