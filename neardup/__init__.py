"""Near-duplicate signatures and the test-set index (paper Section 4.1, after BiT).

The part of de-duplication that the ingest needs, so it sits below :mod:`pipelines`:
:mod:`neardup.signatures` (content hash and 128-bit luminance DCT signatures),
:mod:`neardup.index` (test-set index, multi-index hashing, Arrow persistence),
:mod:`neardup.transforms` (the calibration's crops, resizes and re-encodings) and
:mod:`neardup.report` (the audit sheet). The jobs that read corpora and shard sets
through :mod:`pipelines` (re-checking, calibration) are in :mod:`dedup`.

What counts as a near-duplicate
-------------------------------
A corpus image duplicates a test image when their decoded pixels are identical
(content hash), or when, for one of its codes ``q`` (``signatures.corpus_codes``:
the whole image, and six inner crops for test images cut from it: its
10%-per-side centre trimmed again, its 12%-per-side centre, and per side a crop
of 12% off that side and 6% off the others; all cut from one luminance proxy)
and some crop variant ``v`` of the test image
(``signatures.CROP_VARIANTS``: 29 crops of 0..10% per side, also taken
before border trimming where that differs):

(a) one of the 6 leading 21-bit blocks of ``q`` and ``v`` differs in at most 1
    bit (the *block condition*), and
(b) ``q`` and ``v`` differ in at most ``threshold`` of 128 bits (default
    ``index.DEFAULT_THRESHOLD`` = 28) for the whole-image code, 7 fewer
    (``index.INNER_THRESHOLD_OFFSET``) for an inner crop.

The search (``TestSetIndex.search``/``match``) is exact for this rule: it finds
every pair the rule accepts and no other, and ``TestSetIndex.brute_force``
evaluates the same rule over all pairs to check it. Condition (a) is part of
the definition because it makes the search sub-linear, at a small cost in recall.
The threshold is calibrated on held-out photos (:mod:`dedup.calibration`); its
figures and the command that reproduces them are in benchmarks/README.md, why it
sits there in docs/dedup.md, "How the rule was chosen".

Low-texture images (flat colour, soft gradients) match by content hash only.
"""
