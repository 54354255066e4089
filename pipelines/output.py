"""A ``prepare`` run's hold on its output folder: one writer at a time, and a swap that keeps a set readable.

- **One writer.** A run holds ``DIR/.prepare.lock`` (:class:`common.locks.FolderLock`) from start to
  end, since two runs into one folder would delete each other's staging folders and mix their shards
  under one manifest; a second run says who holds the folder and exits 2.
- **The old set stays readable.** The new shards are written under the run's staging folder; the
  old manifest and shards stay until :meth:`OutputFolder.swap` replaces them at the end, with
  SIGINT and SIGTERM held back. A run killed harder during the swap leaves no manifest (a clear
  refusal), never an old manifest over new shards.
- **Not under a reader.** The run holds the set's readers' lock alone (:class:`common.locks.DataLock`):
  while a pretrain, finetune, vtab or fewshot run reads the set, prepare is refused in one line naming it.
- **A set of other inputs is replaced only with ``--overwrite``,** and a replaced set takes its
  dedup files (``removed.jsonl``, ``dedup_state.json``, ``dedup_index/``, ``dedup_report/``) with
  it: they describe shards that are gone.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from typing import Iterator, Sequence

from common.config import InputError
from common.fs import atomic_write, is_local, read_json_object, url_to_fs
from common.locks import DataLock, FolderLock, check_owner, lock_name
from pipelines import schema

LOCK = lock_name("prepare")
#: What a dedup run writes into a shard set; it holds for those shards only.
DEDUP_FILES = (schema.REMOVED, schema.DEDUP_STATE, "dedup_index", "dedup_report")


class OutputError(InputError):
    """The output folder holds a shard set of other inputs, which this run may not replace."""


def _norm_sources(sources: Sequence[str]) -> list[str]:
    out = []
    for src in sources:
        try:
            fs, path = url_to_fs(src)
            out.append(fs.unstrip_protocol(path))
        except Exception:  # noqa: BLE001 - an unresolvable old source compares as written
            out.append(str(src))
    return sorted(out)


@contextlib.contextmanager
def _signals_held() -> Iterator[list[int]]:
    """SIGINT and SIGTERM wait until the block ends; yields the list they land in, for the caller
    to act on once it has cleaned up (re-sent at once, they cut short its clean-up and tags)."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    old = {s: signal.signal(s, lambda signum, _frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


class OutputFolder:
    """The output folder of one ``prepare`` run, held from ``__enter__`` to ``__exit__``.

    Args:
        url: the folder (local path or fsspec URL); it exists already.
        sources: this run's ``--input``, compared with the sources of a set already there.
        overwrite: replace a set of other inputs (``--overwrite``).
    """

    def __init__(self, url: str, sources: Sequence[str], *, overwrite: bool = False):
        self.output = str(url)
        self.fs, self.root = url_to_fs(url)
        self.sources, self.overwrite = list(sources), overwrite
        self._lock = FolderLock(self.output, "prepare")
        self._readers = DataLock(self.root, "prepare", exclusive=True, field_name="output")
        #: SIGINT or SIGTERM that came during :meth:`swap`, for the run to stop on after its clean-up.
        self.held_signal: int | None = None

    def __enter__(self) -> "OutputFolder":
        if is_local(self.fs):  # a set is known by its manifest.json; another stage's folder is not ours to fill
            check_owner(self.root, "prepare")
        self._lock.acquire()
        try:
            self._check_replaceable()
            self._readers.acquire()  # a set a run reads is never replaced under it
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._readers.release()
        self._lock.release()

    def old_manifest(self) -> dict | None:
        """The manifest of the set in the folder now, ``{}`` if it is unreadable, None if there is none."""
        path = f"{self.root}/{schema.MANIFEST}"
        if not self.fs.exists(path):
            return None
        return read_json_object(self.fs, path)

    def _check_replaceable(self) -> None:
        old = self.old_manifest()
        if old is None or self.overwrite:
            return
        before = old.get("sources")
        if isinstance(before, list) and _norm_sources(before) == _norm_sources(self.sources):
            return
        what = f"a shard set of other inputs ({', '.join(map(str, before))})" if isinstance(before, list) and before \
            else f"a {schema.MANIFEST} this run cannot read"
        raise OutputError(
            f"output {self.output}: holds {what}; pass --overwrite to replace it (its dedup files go with it), "
            "or choose another --output"
        )

    def swap(self, shards_dir: str, manifest: dict, files: dict[str, bytes]) -> None:
        """Make the new set in ``shards_dir`` (the run's staging) the folder's set, ``manifest`` last.

        ``files`` are the set's other files by name (quarantine, duplicates), written before the
        manifest. A set with exactly the old shards keeps the old dedup files: they checked these bytes.
        """
        fs, root = self.fs, self.root
        old = self.old_manifest()
        same = old is not None and [(s.get("path"), s.get("sha256")) for s in old.get("shards", [])
                                    if isinstance(s, dict)] == [(s["path"], s["sha256"]) for s in manifest["shards"]]
        keep = {s["path"] for s in manifest["shards"]}
        with _signals_held() as caught:
            if not same:
                # Withdrawn first: a run killed from here on leaves no manifest, never an old one over new shards.
                if old is not None:
                    fs.rm(f"{root}/{schema.MANIFEST}")
                for name in DEDUP_FILES:
                    if fs.exists(f"{root}/{name}"):
                        fs.rm(f"{root}/{name}", recursive=True)
                for path in fs.glob(f"{root}/shard-*.arrow"):
                    if path.rsplit("/", 1)[-1] not in keep:
                        fs.rm(path)  # a shard of the old set that the new one does not have
                for name in sorted(keep):
                    if is_local(fs):
                        os.replace(f"{shards_dir}/{name}", f"{root}/{name}")  # fs.mv would move it into a folder there
                    else:
                        fs.mv(f"{shards_dir}/{name}", f"{root}/{name}")
            for name, data in files.items():
                atomic_write(f"{root}/{name}", data, fs)
            atomic_write(f"{root}/{schema.MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode(), fs)
        self.held_signal = caught[0] if caught else None
