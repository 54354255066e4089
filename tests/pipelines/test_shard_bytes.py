"""The ingest writes the same bytes as before its memory was bounded (spill files, plan chunks).

The digests below were recorded from main at c5b7bf0, before the ingest changed, on this fixed
corpus: 40 real-photo crops in two classes, one exact copy, one corrupt file and a test-set
copy, cut into several shards. They depend on the pinned Pillow and pyarrow; after an upgrade
that changes encoding, record them again from a commit known to be right.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.pipelines.conftest import run_prepare_cfg
from tests.pipelines.imagefiles import encode

# A fixed place: the shards hold each row's source path, so the corpus cannot move between runs.
CORPUS = Path(tempfile.gettempdir()) / "vitscale-test-shard-bytes"

# {shard name: sha256}, and the sha256 of quarantine.jsonl and duplicates.jsonl, from c5b7bf0.
RECORDED_SHARDS = {
    "shard-00000.arrow": "9c5b606f0256ac411ef5871f11019a36ee6b093a96d83ccc83275522850ebe15",
    "shard-00001.arrow": "1084117782c5886de7b667cc72b66e2fc6ecfd2827124833462c4ca6a0bbf292",
    "shard-00002.arrow": "a7334482e1245398d813d5d0c193056d8e8320f4ac51da543170a235c6746a05",
    "shard-00003.arrow": "b56ed535e612cdff8c668e9b871c90ca2eb5e9b23bd938b57b9b448e24d887f0",
}
RECORDED_SIDE_FILES = {
    "duplicates.jsonl": "85ec63d903d90679a2a637decc1374987194d4319ff53abe0f0228668be010c2",
    "quarantine.jsonl": "999a1148084608c6ee4e7983f1674670ce97b086e4e4f58ea660acb4a58ba1bf",
}
RECORDED_COUNTS = {
    "inputs": 42, "written": 39, "rejected": {"truncated": 1}, "rejected_total": 1,
    "duplicates": {"corpus": 1, "held": 1}, "duplicates_total": 2,
}


def write(path: Path, data: bytes) -> Path:
    """``data`` at ``path``, whole or not at all: test runs at the same time write the same bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def write_corpus(root: Path) -> Path:
    """40 distinct crops of two photographs, an exact copy, a corrupt file; a test set holding one crop."""
    from common.photos import photo

    rng = np.random.default_rng(24)
    src = root / "src"
    crops = []
    for c, name in enumerate(("chelsea.png", "china.jpg")):
        img = photo(name)
        for i in range(20):
            w, h = int(rng.integers(60, 120)), int(rng.integers(60, 120))
            x, y = int(rng.integers(0, img.width - w)), int(rng.integers(0, img.height - h))
            data = encode(img.crop((x, y, x + w, y + h)), "JPEG", quality=90)
            crops.append(write(src / f"class{c}" / f"{i:02d}.jpg", data))
    write(src / "class0" / "copy.jpg", crops[3].read_bytes())
    write(src / "class1" / "broken.jpg", b"\xff\xd8\xff\xe0 not really a jpeg")
    write(root / "test" / "t" / "held.jpg", crops[25].read_bytes())
    return root


def digests(out: Path, manifest: dict) -> tuple[dict, dict]:
    shards = {s["path"]: hashlib.sha256((out / s["path"]).read_bytes()).hexdigest() for s in manifest["shards"]}
    side = {name: hashlib.sha256((out / name).read_bytes()).hexdigest()
            for name in ("quarantine.jsonl", "duplicates.jsonl")}
    return shards, side


@pytest.fixture(scope="module")
def corpus() -> Path:
    return write_corpus(CORPUS)


@pytest.mark.parametrize("workers", [1, 2])
def test_shards_and_side_files_are_byte_identical_to_the_recorded_ones(corpus, tmp_path, workers):
    out = tmp_path / "out"
    manifest = run_prepare_cfg(input=[str(corpus / "src")], output=str(out), size=48, min_short_side=16,
                               shard_mb=0.02, workers=workers, test_set=[f"held={corpus / 'test'}"])
    shards, side = digests(out, manifest)
    assert len(shards) > 2
    assert shards == RECORDED_SHARDS
    assert side == RECORDED_SIDE_FILES
    assert manifest["counts"] == RECORDED_COUNTS
    c = manifest["counts"]
    assert c["inputs"] == c["written"] + c["rejected_total"] + c["duplicates_total"]
