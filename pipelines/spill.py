"""Where the encoded images, and the records' other fields, wait while the records cross the shuffle.

A record is a few hundred bytes of metadata plus its encoded image (tens of KB). Sending the
images through the shuffle made the DirectRunner hold a copy of every image in its own process
(a 1.8 GB peak for 5000 photos of 640x480, so one machine could never ingest ImageNet), costs
Dataflow shuffle bytes, and large values widen the race through which Beam 2.77's multi-worker
DirectRunner drops elements (:mod:`pipelines.direct_runner`). So :class:`SpillImages` appends
each image to one staging file per bundle and passes on ``blob = (file, offset, length)``; the
shard writer reads the images back by range with :class:`Blobs`.

The rest of a record waits there too: the runner holds everything that crosses the shuffle at
once (the DirectRunner keeps every grouped value decoded in its own process), so :class:`SpillRecords` writes the image and then the record's other fields
as one JSON line, and passes on only a :class:`Ref` string: the key and content hash the shard
writer sorts and de-duplicates by, and where the rest is. About 150 bytes cross the shuffle per
input, whatever the record holds.

The files live in the run's staging folder, which the job deletes when it succeeds. A bundle
that fails and is retried leaves a file that no record points to; it goes with the folder.
"""
from __future__ import annotations

import collections
import json
import uuid
from typing import Any, Iterator, NamedTuple

import apache_beam as beam

from common.fs import is_local, url_to_fs

DIR = "blobs"
BLOB = "blob"  # the record field: (file name, offset, length)
_OPEN_FILES = 64  # spill files a reader keeps open at once


class SpillImages(beam.DoFn):
    """Record with ``image`` bytes in -> the same record with ``blob`` instead, the bytes in a staging file."""

    def __init__(self, staging_url: str):
        self._staging = staging_url
        self._file = None

    def setup(self) -> None:
        self._fs, root = url_to_fs(self._staging)
        self._dir = f"{root}/{DIR}"
        self._fs.makedirs(self._dir, exist_ok=True)

    def start_bundle(self) -> None:
        self._file = None

    def _append(self, data: bytes) -> tuple[str, int, int]:
        """Append ``data`` to this bundle's spill file; returns where it is: (file name, offset, length)."""
        if self._file is None:
            self._name = f"{uuid.uuid4().hex}.bin"
            self._file = self._fs.open(f"{self._dir}/{self._name}", "wb")
            self._offset = 0
        self._file.write(data)
        self._offset += len(data)
        return self._name, self._offset - len(data), len(data)

    def process(self, record: dict) -> Iterator[dict]:
        out = {k: v for k, v in record.items() if k != "image"}
        out[BLOB] = self._append(record["image"])
        yield out

    def finish_bundle(self) -> None:
        # The file must be complete before any later step reads it; later steps run
        # after this bundle has finished, since the reader sits behind a GroupByKey.
        if self._file is not None:
            self._file.close()
            self._file = None

    def teardown(self) -> None:
        if self._file is not None:
            self._file.close()


class Ref(NamedTuple):
    """What crosses the shuffle for one record: its sort key, content hash, and where its image and fields are."""

    key: str
    content_hash: str
    blob: tuple[str, int, int]  # the image: (file name, offset, length)
    fields: int  # the length of the JSON fields that follow the image

    def pack(self) -> str:
        return " ".join(map(str, (self.key, self.content_hash, *self.blob, self.fields)))

    @classmethod
    def unpack(cls, text: str) -> "Ref":
        key, content_hash, name, offset, length, fields = text.split(" ")
        return cls(key, content_hash, (name, int(offset), int(length)), int(fields))


_SHUFFLED = ("key", "content_hash")  # the fields a Ref carries itself


def _fields_json(record: dict) -> bytes:
    rest = {k: v for k, v in record.items() if k != "image" and k not in _SHUFFLED}
    binary = sorted(k for k, v in rest.items() if isinstance(v, bytes))
    rest.update({k: rest[k].hex() for k in binary})
    return json.dumps({"fields": rest, "binary": binary}).encode()


def fields_from_json(data: bytes, ref: Ref) -> dict:
    """The record :class:`SpillRecords` spilled, without its image (``labels`` come back a list)."""
    doc = json.loads(data)
    rest = doc["fields"]
    rest.update({k: bytes.fromhex(rest[k]) for k in doc["binary"]})
    return {"key": ref.key, "content_hash": ref.content_hash, **rest}


class SpillRecords(SpillImages):
    """Record in -> its packed :class:`Ref` out; the image and the other fields go to a staging file."""

    def process(self, record: dict) -> Iterator[str]:
        blob = self._append(record["image"])
        fields = self._append(_fields_json(record))
        yield Ref(record["key"], record["content_hash"], blob, fields[2]).pack()


class Blobs:
    """Reads spilled images back: ``read(blob) -> bytes``, keeping the last few files open."""

    def __init__(self, staging_url: str):
        self._fs, root = url_to_fs(staging_url)
        self._dir = f"{root}/{DIR}"
        # Range reads on object stores: no read-ahead, which would fetch megabytes per image.
        self._open_kwargs: dict[str, Any] = {} if is_local(self._fs) else {"cache_type": "none"}
        self._files: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def _file(self, name: str):
        f = self._files.pop(name, None)
        if f is None:
            if len(self._files) >= _OPEN_FILES:
                self._files.popitem(last=False)[1].close()
            f = self._fs.open(f"{self._dir}/{name}", "rb", **self._open_kwargs)
        self._files[name] = f  # most recently used last
        return f

    def read(self, blob: tuple[str, int, int]) -> bytes:
        name, offset, length = blob
        f = self._file(name)
        f.seek(offset)
        data = f.read(length)
        if len(data) != length:
            raise OSError(f"spill file {self._dir}/{name} ends before byte {offset + length}; "
                          "the staging folder was changed during the run")
        return data

    def read_many(self, blobs: list[tuple[str, int, int]]) -> list[bytes]:
        """The images of ``blobs`` in the order given, read file by file and offset by offset."""
        out: list[bytes] = [b""] * len(blobs)
        for i in sorted(range(len(blobs)), key=lambda i: (blobs[i][0], blobs[i][1])):
            out[i] = self.read(blobs[i])
        return out

    def read_records(self, refs: list[Ref]) -> list[tuple[bytes, dict]]:
        """(image, fields) of each ref, in the order given."""
        whole = self.read_many([(r.blob[0], r.blob[1], r.blob[2] + r.fields) for r in refs])
        return [(data[:r.blob[2]], fields_from_json(data[r.blob[2]:], r)) for data, r in zip(whole, refs)]

    def close(self) -> None:
        while self._files:
            self._files.popitem()[1].close()

    def __enter__(self) -> "Blobs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
