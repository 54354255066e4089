"""Test-set index: exact content hashes plus multi-index hashing over signatures.

Section 4.1 of the paper removes pre-training images that duplicate a
downstream test image (after BiT, Kolesnikov et al. 2020). Every corpus image
is looked up here, so the lookup must be sub-linear in the index size and
exact: multi-index hashing (Norouzi et al. 2012).

**The match rule** (this is the definition of a near-duplicate; the search is
exact for it). A corpus image with signature ``q`` duplicates a test image when
its content hash equals the test image's (``Match.exact``), or when for some
crop variant ``v`` of the test image (``signatures.CROP_VARIANTS``):

  (a) *block condition*: one of the ``BLOCKS`` leading ``BLOCK_BITS``-bit blocks
      of ``q`` and ``v`` differs in at most ``BLOCK_RADIUS`` bit, and
  (b) *distance condition*: the whole ``CODE_BITS``-bit codes differ in at most
      ``threshold`` bits for the whole-image code, ``threshold -
      INNER_THRESHOLD_OFFSET`` for an inner-crop code.

The corpus side carries ``signatures.CORPUS_CODES`` codes
(``signatures.corpus_codes``): ``q`` is each of them in turn. The whole-image
code finds a corpus image that is a crop or copy of the test image
(``FORWARD``); its inner crops (``signatures.INNER_CROPS``) find a corpus image
that a test image was cut from (``REVERSE``, up to 10% per side). Low-texture images
(``signatures.LOW_TEXTURE_MARGIN``) carry no codes on either side and match by
content hash only. ``Match.distance`` is the smallest (b)-distance over the
corpus codes and the variants that satisfy (a), taken from the code that
passes (b) with the most room. The rule depends on nothing but the two images and the threshold, and
:meth:`TestSetIndex.search` returns exactly the pairs it accepts:
:meth:`TestSetIndex.brute_force` evaluates it over all pairs, and the tests and
the benchmark check that both agree. Condition (a) is part of the rule because
it is what makes the search sub-linear: every bucket within the radius of each
block is probed (one array read each; buckets are CSR arrays indexed by the
block value) and candidates are verified on (b). No sub-linear exact search
exists for (b) alone at so loose a radius, so the rule carries (a); what that
costs in recall is in docs/dedup.md, "How the rule was chosen".

The index is picklable (a Beam side input); the bucket tables are rebuilt
lazily after unpickling. ``save``/``load`` write one Arrow IPC file per test
set and version holding the records added in that version, tagged in the
schema metadata, so adding to a large test set rewrites nothing. An index saved
under other crop variants or another signature version cannot be extended or
searched consistently; ``load`` refuses it (:class:`IndexOutdated`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
from PIL import Image

from common.fs import atomic_open, atomic_write
from neardup import signatures as sig

# The match rule: some block within BLOCK_RADIUS bits AND the whole code within
# the threshold. 21-bit blocks (6 of them cover 126 of the 128 bits) keep buckets
# near one entry for 100k test images x 29 crop variants, which is what bounds
# the candidates verified per query.
BLOCK_BITS = 21
BLOCKS = sig.CODE_BITS // BLOCK_BITS
BLOCK_RADIUS = 1
INDEX_FORMAT = 1
# Hamming bits for (b); chosen on the calibration pool (dedup.calibration), checked on held-out photos.
DEFAULT_THRESHOLD = 28
# The inner-crop codes (the reverse direction) are matched this many bits
# tighter: each corpus image brings six of them, and every false pair of the
# calibration pool under signature version 5 at 22..24 bits came from one;
# 21 is the loosest with none on the design split (docs/dedup.md, "How the rule was chosen").
INNER_THRESHOLD_OFFSET = 7


class Match(NamedTuple):
    """One test image a corpus image duplicates under the match rule (module docstring).

    ``exact``: identical decoded pixels (content hash), ``distance`` 0. Otherwise
    ``distance`` is the Hamming distance to the closest crop variant that passes
    the block condition (a), at most the index threshold (b).
    """

    test_set: str
    key: str
    distance: int
    exact: bool
    direction: str = "exact"  # FORWARD, REVERSE or "exact"
    uri: str = ""  # the test image's uri, as indexed


# Which corpus code matched (signatures.corpus_codes): the whole corpus image
# (it is a crop or copy of the test image) or one of its inner crops (the test
# image is a crop of it).
FORWARD = "corpus_in_test"
REVERSE = "test_in_corpus"


class IndexOutdated(ValueError):
    """A saved index was built by a different signature version or crop-variant set; rebuild it."""


def rule_id(threshold: int) -> str:
    """Identity of the match rule at ``threshold``: equal ids accept exactly the same pairs."""
    rule = {"signature_version": sig.SIGNATURE_VERSION, "crop_variants": sig.CROP_VARIANTS,
            "inner_crops": sig.INNER_CROPS, "inner_trim": sig.INNER_TRIM,
            "inner_threshold_offset": INNER_THRESHOLD_OFFSET,
            "block_bits": BLOCK_BITS, "blocks": BLOCKS, "block_radius": BLOCK_RADIUS, "threshold": int(threshold)}
    return hashlib.sha256(json.dumps(rule, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass
class Quarantined:
    test_set: str
    key: str
    source: str
    reason: str
    detail: str


class _Probe:
    """CSR bucket tables over the blocks of the indexed codes, all blocks in one table.

    Block ``j``'s bucket for value ``v`` is ``order[offsets[key]:offsets[key + 1]]`` with
    ``key = j << BLOCK_BITS | v``: one gather probes every block of every query at once
    (a per-block loop cost a numpy round trip per block, which dominated the ingest's
    one-record lookups).
    """

    def __init__(self, codes: np.ndarray):
        self.bits, self.m, self.radius = BLOCK_BITS, BLOCKS, BLOCK_RADIUS
        n = len(codes)
        blocks = _blocks(codes)
        orders, offsets = [], []
        for j in range(self.m):
            orders.append(np.argsort(blocks[:, j], kind="stable").astype(np.int32))
            counts = np.bincount(blocks[:, j], minlength=1 << self.bits)
            offsets.append(np.cumsum(counts) - counts + j * n)
        self.order = np.concatenate(orders) if orders else np.zeros(0, dtype=np.int32)
        self.offsets = np.concatenate(offsets + [[self.m * n]]).astype(np.int64 if self.m * n >= 2 ** 31 else np.int32)
        self.masks = _masks(self.bits, self.radius)
        self.block_base = np.arange(self.m, dtype=np.int64) << self.bits


# Where each BLOCK_BITS-bit block sits in the WORDS 64-bit words of a code: block j is
# (word a << left | word b >> right) & mask, word WORDS standing for zero.
def _block_layout() -> tuple[np.ndarray, ...]:
    a, b, left, right = [], [], [], []
    for j in range(sig.CODE_BITS // BLOCK_BITS):
        w, shift = divmod(j * BLOCK_BITS, 64)
        if shift + BLOCK_BITS <= 64:
            a.append(sig.WORDS), b.append(w), left.append(0), right.append(64 - BLOCK_BITS - shift)
        else:  # straddles two words
            low = shift + BLOCK_BITS - 64
            a.append(w), b.append(w + 1), left.append(low), right.append(64 - low)
    return np.array(a), np.array(b), np.array(left, dtype=np.uint64), np.array(right, dtype=np.uint64)


_LAYOUT = _block_layout()


def _blocks(words: np.ndarray) -> np.ndarray:
    """(n, BLOCKS) int64: the leading BLOCK_BITS-bit blocks of (n, WORDS) uint64 codes."""
    a, b, left, right = _LAYOUT
    ext = np.concatenate([words, np.zeros((len(words), 1), dtype=np.uint64)], axis=1)
    v = (ext[:, a] << left) | (ext[:, b] >> right)
    return (v & np.uint64((1 << BLOCK_BITS) - 1)).astype(np.int64)


def _masks(bits: int, radius: int) -> np.ndarray:
    masks = [0]
    frontier = [0]
    for _ in range(radius):
        frontier = sorted({f | (1 << b) for f in frontier for b in range(bits) if not f >> b & 1})
        masks.extend(frontier)
    return np.array(masks, dtype=np.int64)


def _fingerprint(hashes: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(sorted(hashes)).encode()).hexdigest()


class TestSetIndex:
    """Reference side of query-vs-reference de-duplication: the downstream test images.

    Args:
        threshold: largest Hamming distance (over ``CODE_BITS`` bits) that counts as
            a near-duplicate; ``None`` uses the calibrated ``DEFAULT_THRESHOLD``.
    """

    __test__ = False  # not a pytest class

    def __init__(self, *, threshold: int | None = None):
        self.threshold = DEFAULT_THRESHOLD if threshold is None else int(threshold)
        if not 0 <= self.threshold < sig.CODE_BITS:
            raise ValueError(f"threshold={threshold}: expected 0..{sig.CODE_BITS - 1} bits of {sig.CODE_BITS}")
        self.test_set: list[str] = []
        self.key: list[str] = []
        self.source: list[str] = []
        self.content_hashes: list[str] = []
        self.signature: list[bytes] = []
        self.version_of: list[int] = []
        self.versions: dict[str, int] = {}
        self.quarantine: list[Quarantined] = []
        self._codes: list[np.ndarray] = []  # per record: (variants, SIGNATURE_BYTES) uint8
        self._by_hash: dict[str, list[int]] = {}
        self._keys: set[tuple[str, str]] = set()
        self._pending: dict[str, bool] = {}
        self._saved: dict[str, int] = {}
        self._words: np.ndarray | None = None
        self._owner: np.ndarray | None = None
        self._probe: _Probe | None = None
        self._columns: list[np.ndarray] | None = None

    # -- building -----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.key)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_probe"] = state["_columns"] = None
        return state

    def add(self, test_set: str, key: str, img: Image.Image | None = None, *, source: str = "",
            content_hash: str | None = None, codes: np.ndarray | None = None) -> bool:
        """Index one test image (decoded) or its precomputed hash and variant codes.

        Returns False, changing nothing, when ``(test_set, key)`` is already indexed,
        which is what makes rebuilding from a grown source incremental.
        """
        if (test_set, key) in self._keys:
            return False
        if img is not None:
            content_hash = sig.content_hash(img)
            codes = sig.variant_codes(img)
        if content_hash is None or codes is None:
            raise ValueError(f"{test_set}/{key}: pass a decoded image or both content_hash and codes")
        if not self._pending.get(test_set):
            self.versions[test_set] = self.versions.get(test_set, 0) + 1
            self._pending[test_set] = True
        self._append(test_set, key, source, content_hash, codes, self.versions[test_set])
        return True

    def _append(self, test_set: str, key: str, source: str, content_hash: str, codes: np.ndarray,
                version: int) -> None:
        codes = np.asarray(codes, dtype=np.uint8).reshape(-1, sig.SIGNATURE_BYTES)
        i = len(self.key)
        self.test_set.append(test_set)
        self.key.append(key)
        self.source.append(source)
        self.content_hashes.append(content_hash)
        self.signature.append(codes[0].tobytes() if len(codes) else bytes(sig.SIGNATURE_BYTES))
        self.version_of.append(version)
        self._codes.append(codes)
        self._by_hash.setdefault(content_hash, []).append(i)
        self._keys.add((test_set, key))
        self._words = self._owner = self._probe = self._columns = None

    def add_quarantine(self, item: Quarantined) -> None:
        self.quarantine.append(item)

    def has_key(self, test_set: str, key: str) -> bool:
        """Whether ``key`` is already indexed under ``test_set``."""
        return (test_set, key) in self._keys

    def commit(self) -> None:
        """Close the current version of every test set that received records."""
        self._pending.clear()

    def fingerprint(self, test_set: str) -> str:
        """sha256 over the sorted content hashes of ``test_set``: changes iff its images change."""
        return _fingerprint(h for h, t in zip(self.content_hashes, self.test_set) if t == test_set)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.test_set:
            out[t] = out.get(t, 0) + 1
        return out

    # -- searching ----------------------------------------------------------------

    def _ensure(self) -> _Probe:
        if self._words is None:
            if self._codes:
                flat = np.concatenate(self._codes)
                owner = np.concatenate([np.full(len(c), i, dtype=np.int32) for i, c in enumerate(self._codes)])
            else:
                flat = np.zeros((0, sig.SIGNATURE_BYTES), dtype=np.uint8)
                owner = np.zeros(0, dtype=np.int32)
            self._words = sig.to_words(flat)
            self._owner = owner
        if self._probe is None:
            self._probe = _Probe(self._words)
        return self._probe

    def rule_id(self) -> str:
        return rule_id(self.threshold)

    def search(self, queries: np.ndarray, *, chunk: int = 20000, limits: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All (query row, record, distance) the match rule accepts; exact for the rule, sub-linear.

        ``queries`` is (n, SIGNATURE_BYTES) uint8 or (n, WORDS) uint64. For each pair the
        smallest distance over the record's crop variants is returned. ``limits``: the
        distance condition per query row (default: the threshold for every row).
        """
        probe = self._ensure()
        q = queries if queries.dtype == np.uint64 else sig.to_words(queries)
        lim = self._limits(len(q), limits)
        outs = []
        for lo in range(0, len(q), chunk):
            outs.append(self._search_chunk(probe, q[lo: lo + chunk], lo, lim[lo: lo + chunk]))
        if not outs:
            e = np.zeros(0, dtype=np.int64)
            return e, e.copy(), e.copy()
        return tuple(np.concatenate(parts) for parts in zip(*outs))  # type: ignore[return-value]

    def _limits(self, n: int, limits: np.ndarray | None) -> np.ndarray:
        if limits is None:
            return np.full(n, self.threshold, dtype=np.int64)
        return np.asarray(limits, dtype=np.int64)

    def _search_chunk(self, probe: _Probe, q: np.ndarray, base: int, lim: np.ndarray):
        qi, ei, d = self._candidates(probe, q, lim)
        if not len(qi):
            return _NO_PAIRS
        qi, d, rec = qi.astype(np.int64), d.astype(np.int64), self._owner[ei].astype(np.int64)
        # one row per (query, record): the closest variant (a pair found through several blocks too)
        order = np.lexsort((d, rec, qi))
        qi, rec, d = qi[order], rec[order], d[order]
        first = np.ones(len(qi), dtype=bool)
        first[1:] = (qi[1:] != qi[:-1]) | (rec[1:] != rec[:-1])
        return qi[first] + base, rec[first], d[first]

    def _candidates(self, probe: _Probe, q: np.ndarray, lim: np.ndarray) -> tuple[np.ndarray, ...]:
        """(query row, entry, distance) of every (query, indexed code) pair the rule accepts, unreduced.

        An entry is a row of ``_words``; a pair found through several blocks is listed once a block.
        """
        if self._columns is None:
            # views, not copies: a candidate's later words then sit in the cache line its first
            # word's gather brought in, and the index is not held twice
            self._columns = list(self._words.T)
        w0, *w_cols = self._columns
        q0, *q_cols = q.T.copy()  # one contiguous row per word
        # every bucket within the block radius of every block of every query, in one gather
        per_query = probe.m * len(probe.masks)
        keys = ((_blocks(q)[:, :, None] ^ probe.masks) + probe.block_base[:, None]).ravel()
        start = probe.offsets[keys]
        n = probe.offsets[keys + 1] - start
        ends = np.cumsum(n)
        total = int(ends[-1]) if len(ends) else 0
        if total == 0:
            return _NO_PAIRS
        # the buckets laid end to end: candidate i of bucket b sits at order[start[b] + i]
        ei = probe.order[_arange(total) + np.repeat(start - (ends - n), n)]
        qi = np.repeat(_query_of_key(len(q), per_query), n)
        # word by word on 1-D arrays (a (n, 2) gather and a row sum cost twice as much),
        # dropping candidates as soon as their distance passes the limit: most fail on the
        # first word, which spares the later words' gathers (cache misses in a large index).
        # Distances stay uint8 (at most CODE_BITS).
        d = np.bitwise_count(q0[qi] ^ w0[ei])
        for q_w, w_w in zip(q_cols, w_cols):
            keep = np.flatnonzero(d <= lim[qi])
            qi, ei, d = qi[keep], ei[keep], d[keep]
            d += np.bitwise_count(q_w[qi] ^ w_w[ei])
        keep = np.flatnonzero(d <= lim[qi])
        return qi[keep], ei[keep], d[keep]

    def brute_force(self, queries: np.ndarray, *, limits: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The same rule as :meth:`search`, evaluated over every (query, entry) pair; for tests and baselines."""
        self._ensure()
        q = queries if queries.dtype == np.uint64 else sig.to_words(queries)
        lim = self._limits(len(q), limits)
        words, owner = self._words, self._owner
        qb, eb = _blocks(q), _blocks(words)
        out_q, out_r, out_d = [], [], []
        for i in range(len(q)):
            d = np.bitwise_count(words ^ q[i]).sum(axis=1, dtype=np.int64)
            bd = np.bitwise_count(eb ^ qb[i]).min(axis=1)
            ok = np.nonzero((d <= lim[i]) & (bd <= BLOCK_RADIUS))[0]
            best: dict[int, int] = {}
            for e in ok.tolist():
                r = int(owner[e])
                best[r] = min(best.get(r, 1 << 30), int(d[e]))
            for r in sorted(best):
                out_q.append(i)
                out_r.append(r)
                out_d.append(best[r])
        return (np.array(out_q, dtype=np.int64), np.array(out_r, dtype=np.int64), np.array(out_d, dtype=np.int64))

    def exact(self, content_hash: str) -> list[int]:
        """Records whose content hash is ``content_hash`` (the rule's exact half), in index order."""
        return list(self._by_hash.get(content_hash, ()))

    def search_corpus(self, codes: np.ndarray, *, brute: bool = False
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """All (corpus item, record, distance, code) the match rule accepts, for both directions.

        ``codes`` is (n, k, SIGNATURE_BYTES) uint8: each item's ``signatures.corpus_codes``
        split into its k codes (k = 1 for a bare ``compute`` signature: forward only).
        One row per (item, record) pair, from the code that passes the distance condition
        with the most room (the smallest distance, counting ``INNER_THRESHOLD_OFFSET`` on
        inner codes), and its distance; ``code`` is the code that gave it (0: the whole
        image, FORWARD; >= 1: an inner crop, REVERSE). ``brute`` evaluates the same rule
        over all pairs.
        """
        codes = np.asarray(codes, dtype=np.uint8)
        n, k = codes.shape[:2]
        offset = _code_offsets(k)
        qi, rec, d = (self.brute_force if brute else self.search)(
            codes.reshape(n * k, sig.SIGNATURE_BYTES), limits=np.tile(self.threshold - offset, n))
        return _closest_code(qi // k, rec, d, qi % k, offset)

    def match(self, content_hash: str, signature: bytes) -> list[Match]:
        """Every test image that ``(content_hash, signature)`` duplicates, closest first.

        ``signature`` is what the corpus side stores: ``signatures.corpus_codes`` (both
        directions) or a bare ``signatures.compute`` code (forward only).
        """
        out: dict[int, Match] = {}
        for i in self.exact(content_hash):
            out[i] = Match(self.test_set[i], self.key[i], 0, True, "exact", self.source[i])
        if signature and len(self):  # b"": a low-texture corpus image, exact matches only
            # search_corpus for one item, without its wrappers: the ingest looks up record by record
            if len(signature) % sig.SIGNATURE_BYTES:
                sig.split_codes(signature)  # raises, naming the fix
            k = len(signature) // sig.SIGNATURE_BYTES
            q = np.frombuffer(signature, dtype=">u8").reshape(k, sig.WORDS).astype(np.uint64)
            code, entry, dist = self._candidates(self._ensure(), q, _code_limits(k, self.threshold))
            # _closest_code's choice, over the few pairs one item has, in plain Python
            closest: dict[int, tuple[int, int, int]] = {}
            for c, i, d in zip(code.tolist(), self._owner[entry].tolist(), dist.tolist()):
                room = (d + (c > 0) * INNER_THRESHOLD_OFFSET, c, d)
                if room < closest.get(i, (sig.CODE_BITS * 2,)):
                    closest[i] = room
            for i, (_, c, d) in closest.items():
                if i not in out:
                    out[i] = Match(self.test_set[i], self.key[i], d, False, REVERSE if c else FORWARD, self.source[i])
        return sorted(out.values(), key=lambda m: (m.distance, not m.exact, m.test_set, m.key))

    def uri(self, record: int) -> str:
        """The test image's uri (its ``source`` as indexed) of record ``record``."""
        return self.source[record]

    # -- persistence --------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> Path:
        """Write records not yet saved as ``<test_set>.v<version>.arrow`` plus ``index.json``."""
        self.commit()
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        manifest_path = d / "index.json"
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"files": []}
        listed = {f["path"] for f in manifest["files"]}
        for name in sorted(set(self.test_set) | {q.test_set for q in self.quarantine}):
            for version in range(self._saved.get(name, 0) + 1, self.versions.get(name, 0) + 1):
                rows = [i for i, (t, v) in enumerate(zip(self.test_set, self.version_of)) if t == name and v == version]
                path = f"{_safe(name)}.v{version}.arrow"
                if path in listed:
                    continue
                _write_records(d / path, self, name, version, rows)
                manifest["files"].append({"test_set": name, "version": version, "path": path, "rows": len(rows)})
            self._saved[name] = self.versions.get(name, 0)
        quarantine = [dataclasses.asdict(q) for q in self.quarantine]
        manifest.update({
            "format": INDEX_FORMAT,
            "signature_version": sig.SIGNATURE_VERSION,
            "crop_variants": [list(v) for v in sig.CROP_VARIANTS],
            "threshold": self.threshold,
            "rule": rule_id(self.threshold),
            "test_sets": {name: {"version": self.versions.get(name, 0), "images": n,
                                 "fingerprint": self.fingerprint(name)}
                          for name, n in sorted(self.counts().items())},
            "quarantine": quarantine,
        })
        atomic_write(manifest_path, json.dumps(manifest, indent=2))
        return d

    @classmethod
    def load(cls, directory: str | os.PathLike, *, threshold: int | None = None) -> "TestSetIndex":
        d = Path(directory)
        manifest_path = d / "index.json"
        if not manifest_path.is_file():
            raise FileNotFoundError(f"{d}: no index.json; build it with pipelines.testsets.build_test_set_index(...).save(dir), as jobs/dedup.py does")
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("signature_version") != sig.SIGNATURE_VERSION:
            raise IndexOutdated(
                f"{manifest_path}: signatures are version {manifest.get('signature_version')}, this code computes "
                f"version {sig.SIGNATURE_VERSION}; delete {d} and rebuild the index from its test-set sources")
        variants = [tuple(v) for v in manifest.get("crop_variants", [])]
        if variants != list(sig.CROP_VARIANTS):
            raise IndexOutdated(
                f"{manifest_path}: built with {len(variants) or 'unrecorded'} crop variants, this code indexes "
                f"{len(sig.CROP_VARIANTS)} (neardup.signatures.CROP_VARIANTS); delete {d} and rebuild the index "
                "from its test-set sources")
        index = cls(threshold=manifest.get("threshold") if threshold is None else threshold)
        for entry in sorted(manifest["files"], key=lambda f: (f["test_set"], f["version"])):
            path = d / entry["path"]
            if not path.is_file():
                raise FileNotFoundError(f"{path}: listed in {manifest_path} but missing; rebuild the index")
            with pa.memory_map(os.fsencode(path)) as src:  # bytes: a folder name need not be UTF-8
                table = ipc.open_file(src).read_all()
            meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
            name, version = meta["test_set"], int(meta["version"])
            index.versions[name] = max(index.versions.get(name, 0), version)
            cols = table.to_pydict()
            for key, source, chash, codes in zip(cols["key"], cols["source"], cols["content_hash"], cols["codes"]):
                if (name, key) not in index._keys:
                    index._append(name, key, source, chash, np.frombuffer(codes, dtype=np.uint8), version)
            index._saved[name] = index.versions[name]
        index.quarantine = [Quarantined(**q) for q in manifest.get("quarantine", [])]
        return index


# The ingest looks records up one at a time, where every numpy call costs about as much as the
# memory reads of the search, and the lookup must stay within 5% of the ingest's item time
# with the signatures: what depends only on sizes is made once and reused.
@functools.lru_cache(maxsize=16)
def _code_offsets(k: int) -> np.ndarray:
    """What each of an item's ``k`` corpus codes adds to its distance: 0 for the whole image, the inner offset after."""
    return _frozen(np.where(np.arange(k) > 0, INNER_THRESHOLD_OFFSET, 0))


@functools.lru_cache(maxsize=16)
def _code_limits(k: int, threshold: int) -> np.ndarray:
    """The distance condition (b) for each of an item's ``k`` corpus codes."""
    return _frozen(threshold - _code_offsets(k))


def _query_of_key(queries: int, per_query: int) -> np.ndarray:
    """The query row of each probed bucket key (``per_query`` keys a query, query by query)."""
    if queries > 64:  # a batch search: kept out of the cache, which would hold its size for good
        return np.arange(queries * per_query) // per_query
    return _query_of_key_cached(queries, per_query)


@functools.lru_cache(maxsize=16)
def _query_of_key_cached(queries: int, per_query: int) -> np.ndarray:
    return _frozen(np.arange(queries * per_query) // per_query)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


_NO_PAIRS = tuple(_frozen(np.zeros(0, dtype=np.int64)) for _ in range(3))
_ARANGE = _frozen(np.arange(1 << 16))


def _arange(n: int) -> np.ndarray:
    """``np.arange(n)``, read-only: a view of one shared array at the sizes of a one-record lookup."""
    return _ARANGE[:n] if n <= len(_ARANGE) else np.arange(n)


def _closest_code(item: np.ndarray, rec: np.ndarray, d: np.ndarray, code: np.ndarray, offset: np.ndarray):
    """One row per (item, record): the code that passes the distance condition with the most room."""
    if not len(item):
        return item, rec, d, code
    order = np.lexsort((code, d + offset[code], rec, item))
    item, rec, d, code = item[order], rec[order], d[order], code[order]
    first = np.ones(len(item), dtype=bool)
    first[1:] = (item[1:] != item[:-1]) | (rec[1:] != rec[:-1])
    return item[first], rec[first], d[first], code[first]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _write_records(path: Path, index: TestSetIndex, name: str, version: int, rows: list[int]) -> None:
    schema = pa.schema(
        [("key", pa.string()), ("source", pa.string()), ("content_hash", pa.string()),
         ("signature", pa.binary(sig.SIGNATURE_BYTES)), ("codes", pa.binary())],
        metadata={"test_set": name, "version": str(version), "signature_version": str(sig.SIGNATURE_VERSION),
                  "crop_variants": json.dumps(sig.CROP_VARIANTS)},
    )
    table = pa.table({
        "key": [index.key[i] for i in rows],
        "source": [index.source[i] for i in rows],
        "content_hash": [index.content_hashes[i] for i in rows],
        "signature": [index.signature[i] for i in rows],
        "codes": [index._codes[i].tobytes() for i in rows],
    }, schema=schema)
    with atomic_open(path) as sink, ipc.new_file(sink, schema) as writer:
        writer.write_table(table)
