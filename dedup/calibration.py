"""Calibration of the near-duplicate detector: transformed positives, distinct negatives, a threshold.

From any set of images, each image is indexed as a "test image", every
transform of :mod:`neardup.transforms` is applied to it to make a positive query,
and every other image is a negative. Per transform and per threshold the tool
reports precision, recall and false-match rate (FMR), overall FMR over all
distinct ordered pairs, and plots them to a PNG.

The pool (:func:`photo_pool`) is the bundled photographs (:mod:`common.photos`) plus their
non-overlapping tiles, which are hard negatives; ``--holdout`` splits it by source photograph
so the threshold is chosen on one part and measured on the other. ``DEFAULT_THRESHOLD`` in
:mod:`neardup.index` is this tool's choice. The recorded results, per transform, and the command
that reproduces them: benchmarks/README.md, "Near-duplicate recall and false matches"; why the
rule is what it is: docs/dedup.md, "How the rule was chosen".

Reverse transforms (``transforms.REVERSE_TRANSFORMS``: the transformed image is the test
image, cut from the original) index the transformed images and search the originals' corpus
codes. ``low_texture.json`` records what the low-texture rule is for.

Negatives are every ordered pair of distinct pool images. Tiles of one photo do not overlap,
so they stay negatives (the hardest ones); the table also splits the false pairs into pairs of
different source photos and pairs within one photo, so neither count hides the other.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from PIL import Image

from common import plots, tracking
from common.photos import ALL
from common.photos import photos as load_photos
from neardup import signatures as sig
from neardup.index import DEFAULT_THRESHOLD, INNER_THRESHOLD_OFFSET, TestSetIndex
from neardup.transforms import RANDOM_TRANSFORMS, REVERSE_TRANSFORMS, TRANSFORMS, apply
from pipelines.testsets import iter_images

TARGET_RECALL = 0.98
TARGET_FMR = 1e-4


def photo_pool(*, tile: int = 128, min_std: float = 12.0) -> list[tuple[str, Image.Image]]:
    """Real photographs bundled with scikit-image and scikit-learn, plus non-overlapping tiles of them.

    Tiles of one photo are distinct images (no pixel in common) yet share its
    statistics, which makes them hard negatives. Flat tiles (sky, black
    background) are dropped: they are duplicates of each other in any sense.
    """
    photos = list(load_photos(ALL).items())
    pool = list(photos)
    for name, photo in photos:
        arr = np.asarray(photo)
        for y in range(0, arr.shape[0] - tile + 1, tile):
            for x in range(0, arr.shape[1] - tile + 1, tile):
                t = Image.fromarray(arr[y:y + tile, x:x + tile])
                if np.asarray(t.convert("L"), dtype=np.float32).std() >= min_std:
                    pool.append((f"{name}@{x},{y}", t))
    return pool


HOLDOUT_PHOTOS = ("hubble_deep_field.jpg", "brick.png", "ihc.png", "china.jpg", "camera.png", "chelsea.png",
                  "coins.png", "cell.png")


def split_pool(pool: Sequence[tuple[str, Image.Image]], holdout: Iterable[str] = HOLDOUT_PHOTOS
               ) -> tuple[list[tuple[str, Image.Image]], list[tuple[str, Image.Image]]]:
    """(design, held-out) by *source photograph*: a photo and all its tiles go to the same side.

    Tiles of one photo share its statistics, so splitting tiles at random would
    leak the design photos into the held-out figures.
    """
    holdout = set(holdout)
    sources = {name.split("@")[0] for name, _ in pool}
    unknown = holdout - sources
    if unknown:
        raise ValueError(f"held-out photos {sorted(unknown)} are not in the pool; choose from {sorted(sources)}")
    design = [(n, img) for n, img in pool if n.split("@")[0] not in holdout]
    held = [(n, img) for n, img in pool if n.split("@")[0] in holdout]
    if len(design) < 2 or len(held) < 2:
        raise ValueError(f"split leaves {len(design)} design and {len(held)} held-out images; need 2 of each")
    return design, held


@dataclasses.dataclass
class Calibration:
    """Figures of the match rule (neardup.index) per transform and threshold.

    ``recall`` is under the full rule (block condition included), as the index
    searches; ``plain_recall`` drops the block condition ("Hamming <= threshold
    on some crop variant"), so the difference is what the block condition costs.
    """
    thresholds: list[int]
    n_images: int
    transforms: list[str]
    positives: dict[str, int]  # transform -> transformed queries (random transforms are sampled repeatedly)
    recall: dict[str, list[float]]  # transform -> per threshold
    plain_recall: dict[str, list[float]]
    precision: dict[str, list[float]]
    fmr: dict[str, list[float]]  # transform -> false matches of its queries / (queries * (n - 1))
    overall_recall: list[float]  # mean over transforms
    overall_plain_recall: list[float]
    overall_fmr: list[float]  # originals vs every other original, over n * (n - 1) ordered pairs
    false_pairs: list[int]  # distinct ordered pairs matched, per threshold
    # The same split by source photograph (``groups``): pairs of different photos, the
    # negatives proper; the rest are non-overlapping tiles of one photo, or a photo and
    # one of its tiles (a quarter of it or less, far beyond a 10% crop), reported apart.
    cross_source_pairs: int | None = None
    cross_source_false_pairs: list[int] | None = None

    def at(self, threshold: int) -> dict[str, float]:
        i = self.thresholds.index(threshold)
        out = {"recall": self.overall_recall[i], "plain_recall": self.overall_plain_recall[i],
               "fmr": self.overall_fmr[i], "false_pairs": self.false_pairs[i]}
        out.update({f"recall.{t}": self.recall[t][i] for t in self.transforms})
        out.update({f"plain_recall.{t}": self.plain_recall[t][i] for t in self.transforms})
        return out

    def choose_threshold(self, max_fmr: float = TARGET_FMR / 5) -> int:
        """Largest threshold whose distinct-pair FMR is at most ``max_fmr``."""
        ok = [t for t, f in zip(self.thresholds, self.overall_fmr) if f <= max_fmr]
        return max(ok) if ok else min(self.thresholds)

    def table(self) -> str:
        lines = ["threshold  recall  plain   fmr       false pairs  worst transform"]
        for i, t in enumerate(self.thresholds):
            worst = min(self.transforms, key=lambda n: self.recall[n][i])
            lines.append(f"{t:9d}  {self.overall_recall[i]:.4f}  {self.overall_plain_recall[i]:.4f}  "
                         f"{self.overall_fmr[i]:.2e}  {self.false_pairs[i]:11d}  {worst} {self.recall[worst][i]:.3f}")
        return "\n".join(lines)

    def transform_table(self, threshold: int) -> str:
        """Per transform at one threshold: positives, recall (rule), plain recall, precision, FMR."""
        i = self.thresholds.index(threshold)
        lines = [f"threshold {threshold}, {self.n_images} images, {self.n_images * (self.n_images - 1)} distinct pairs",
                 f"{'transform':20s} {'queries':>7s} {'recall':>7s} {'plain':>7s} {'prec':>7s} {'fmr':>9s}"]
        for t in self.transforms:
            lines.append(f"{t:20s} {self.positives[t]:7d} {self.recall[t][i]:7.3f} {self.plain_recall[t][i]:7.3f} "
                         f"{self.precision[t][i]:7.3f} {self.fmr[t][i]:9.2e}")
        lines.append(f"{'all (mean)':20s} {sum(self.positives.values()):7d} {self.overall_recall[i]:7.3f} "
                     f"{self.overall_plain_recall[i]:7.3f} {'':7s} {self.overall_fmr[i]:9.2e} "
                     f"({self.false_pairs[i]} distinct pairs)")
        if self.cross_source_pairs is not None:
            c = self.cross_source_false_pairs[i]
            lines.append(f"{'':20s} of them between different source photos: {c} of {self.cross_source_pairs} "
                         f"({c / max(self.cross_source_pairs, 1):.2e}); within one photo: {self.false_pairs[i] - c} of "
                         f"{self.n_images * (self.n_images - 1) - self.cross_source_pairs}")
        return "\n".join(lines)


def calibrate(images: Sequence[Image.Image], *, transforms: Iterable[str] | None = None,
              thresholds: Sequence[int] = tuple(range(0, 49, 2)), seed: int = 0, repeats: int = 1,
              groups: Sequence[str] | None = None) -> Calibration:
    """Measure recall, precision and FMR of the match rule per transform and threshold on ``images``.

    Transforms in ``RANDOM_TRANSFORMS`` are applied ``repeats`` times per image with different seeds.
    ``groups`` (the source photograph of each image) splits the false pairs into pairs of
    different photos and pairs within one photo.
    """
    names = list(transforms or TRANSFORMS)
    thresholds = sorted(int(t) for t in thresholds)
    n = len(images)
    if n < 2:
        raise ValueError(f"calibration needs at least 2 distinct images, got {n}")
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: expected at least 1")
    index = TestSetIndex(threshold=max(thresholds))
    corpus = []  # each image's corpus-side codes: the whole image and its inner crops
    for i, img in enumerate(images):
        img = img.convert("RGB")
        index.add("calibration", str(i), img)
        corpus.append(_codes(img))
    pairs = n * (n - 1)
    qi, rec, d, _ = _search(index, corpus)
    off = qi != rec
    false_pairs = [int(np.count_nonzero(off & (d <= t))) for t in thresholds]
    cross_pairs = cross_false = None
    if groups is not None:
        g = np.unique(np.asarray(groups), return_inverse=True)[1]
        sizes = np.bincount(g)
        cross_pairs = int(n * n - (sizes ** 2).sum())
        cross = g[qi] != g[rec]
        cross_false = [int(np.count_nonzero(cross & (d <= t))) for t in thresholds]
    overall_fmr = [f / pairs for f in false_pairs]

    recall, plain_recall, precision, fmr, positives = {}, {}, {}, {}, {}
    for name in names:
        reps = repeats if name in RANDOM_TRANSFORMS else 1
        owner = np.tile(np.arange(n), reps)
        made = [apply(name, images[i], seed=seed + r * 100_003 + i) for r in range(reps) for i in range(n)]
        m = len(made)
        if name in REVERSE_TRANSFORMS:
            # the transformed images are the test images, cut from the originals: index them
            # and search every original's corpus codes (n queries, m test images)
            rev = TestSetIndex(threshold=max(thresholds))
            for k, img in enumerate(made):
                rev.add("calibration", str(k), img)
            item, r_, d, _ = _search(rev, corpus)
            true = owner[r_] == item
            variants = [sig.to_words(c) for c in rev._codes]
            plain = np.array([_plain(variants[k], corpus[owner[k]]) for k in range(m)])
        else:
            queries = [_codes(img) for img in made]
            item, r_, d, _ = _search(index, queries)
            true = owner[item] == r_
            plain = np.array([_plain(index_variants(index, owner[k]), queries[k]) for k in range(m)])
        tp = np.array([np.count_nonzero(true & (d <= t)) for t in thresholds], dtype=float)
        fp = np.array([np.count_nonzero(~true & (d <= t)) for t in thresholds], dtype=float)
        positives[name] = m
        recall[name] = (tp / m).tolist()
        plain_recall[name] = [float(np.mean(plain <= t)) for t in thresholds]
        precision[name] = np.where(tp + fp > 0, tp / np.maximum(tp + fp, 1), 1.0).tolist()
        fmr[name] = (fp / (m * (n - 1))).tolist()
    overall_recall = np.mean([recall[t] for t in names], axis=0).tolist()
    overall_plain = np.mean([plain_recall[t] for t in names], axis=0).tolist()
    return Calibration(thresholds, n, names, positives, recall, plain_recall, precision, fmr, overall_recall,
                       overall_plain, overall_fmr, false_pairs, cross_pairs, cross_false)


def _codes(img: Image.Image) -> np.ndarray:
    """(CORPUS_CODES, SIGNATURE_BYTES) corpus-side codes, as the ingest stores them; (0, ...) for low texture."""
    return np.frombuffer(sig.corpus_codes(img), dtype=np.uint8).reshape(-1, sig.SIGNATURE_BYTES)


def _search(index, codes: Sequence[np.ndarray]):
    """``index.search_corpus`` over the items that carry codes (low-texture ones match by hash only).

    The distance returned counts ``INNER_THRESHOLD_OFFSET`` on inner codes, so that
    ``distance <= threshold`` is the rule at any threshold of the sweep.
    """
    coded = np.array([i for i, c in enumerate(codes) if len(c)], dtype=np.int64)
    if not len(coded):
        e = np.zeros(0, dtype=np.int64)
        return e, e.copy(), e.copy(), e.copy()
    item, rec, d, code = index.search_corpus(np.stack([codes[i] for i in coded]))
    return coded[item], rec, d + np.where(code > 0, INNER_THRESHOLD_OFFSET, 0), code


def index_variants(index, record: int) -> np.ndarray:
    return sig.to_words(index._codes[record])


def _plain(variants: np.ndarray, codes: np.ndarray) -> int:
    """Smallest Hamming distance between any corpus code and any crop variant (no block condition)."""
    if not len(variants) or not len(codes):  # low texture: no codes, exact matches only
        return 1 << 30
    q = sig.to_words(codes)
    d = np.bitwise_count(variants[None, :, :] ^ q[:, None, :]).sum(axis=2).min(axis=1)
    return int((d + np.where(np.arange(len(d)) > 0, INNER_THRESHOLD_OFFSET, 0)).min())


def low_texture_pool(n: int = 48, seed: int = 0, size: tuple[int, int] = (320, 240)) -> list[tuple[str, Image.Image]]:
    """Procedural low-texture images: flat colours with sensor-like noise, linear and radial soft gradients."""
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w] / np.array([h, w])[:, None, None]
    out = []
    for i in range(n):
        c0, c1 = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
        kind = ("flat", "linear", "linear", "radial")[i % 4]
        if kind == "flat":
            a = np.ones((h, w, 3)) * c0 + rng.normal(0, 1.0, (h, w, 3))
        elif kind == "linear":
            th = rng.uniform(0, 2 * np.pi)
            t = np.cos(th) * xx + np.sin(th) * yy
            a = c0 + (c1 - c0) * ((t - t.min()) / (np.ptp(t) + 1e-9))[..., None]
        else:
            cx, cy = rng.uniform(0.2, 0.8, 2)
            r = np.sqrt((xx - cx) ** 2 + (yy - cy) ** 2)
            a = c0 + (c1 - c0) * (r / r.max())[..., None]
        out.append((f"{kind}{i}", Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))))
    return out


def low_texture_report(photos: Sequence[Image.Image], *, threshold: int = DEFAULT_THRESHOLD) -> dict:
    """What the low-texture rule (``signatures.LOW_TEXTURE_MARGIN``) is for, measured.

    Margins of real photos against procedural flat images and gradients, and, with
    the rule switched off (codes computed regardless), how often those images
    match each other (false pairs), photos, or their own JPEG q30 copies.
    """
    low = [img for _, img in low_texture_pool()]
    photo_margins = np.array([sig.texture_margin(im) for im in photos])
    low_margins = np.array([sig.texture_margin(im) for im in low])

    codes_without_rule = sig.corpus_codes_any_texture

    def variants_without_rule(img):
        return sig.variant_codes(img, any_texture=True)[:len(sig.CROP_VARIANTS)]

    index = TestSetIndex(threshold=threshold)
    for i, img in enumerate(low):
        index.add("low", str(i), content_hash=f"low{i}", codes=variants_without_rule(img))
    low_q = np.stack([codes_without_rule(im) for im in low])
    item, rec, _, _ = index.search_corpus(low_q)
    false_pairs = int(np.count_nonzero(item != rec))
    jpeg = np.stack([codes_without_rule(apply("jpeg_q30", im)) for im in low])
    item, rec, _, _ = index.search_corpus(jpeg)
    own = int(np.count_nonzero(item == rec))
    photo_q = np.stack([codes_without_rule(im) for im in photos])
    item, _, _, _ = index.search_corpus(photo_q)
    return {
        "low_texture_margin": sig.LOW_TEXTURE_MARGIN,
        "photos": len(photos), "photo_margin_min": round(float(photo_margins.min()), 2),
        "photo_margin_p1": round(float(np.percentile(photo_margins, 1)), 2),
        "photos_below_margin": int(np.count_nonzero(photo_margins < sig.LOW_TEXTURE_MARGIN)),
        "low_texture_images": len(low), "low_texture_margin_max": round(float(low_margins.max()), 2),
        "low_texture_below_margin": int(np.count_nonzero(low_margins < sig.LOW_TEXTURE_MARGIN)),
        "without_rule_false_pairs": false_pairs, "without_rule_pairs": len(low) * (len(low) - 1),
        "without_rule_jpeg_q30_recall": round(own / len(low), 3),
        "without_rule_photos_matching_low_texture": int(len(set(item.tolist()))),
    }


def plot(cal: Calibration, path: str | os.PathLike, *, default: int = DEFAULT_THRESHOLD) -> Path:
    """Recall per transform, precision and FMR against the threshold, as one PNG."""
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    for name in cal.transforms:
        axes[0].plot(cal.thresholds, cal.recall[name], label=name, lw=1)
        axes[1].plot(cal.thresholds, cal.precision[name], lw=1)
    axes[0].plot(cal.thresholds, cal.overall_recall, "k-", lw=2.5, label="all transforms")
    axes[0].axhline(TARGET_RECALL, color="grey", ls=":")
    axes[0].set(title="recall per transform", xlabel="threshold (bits)", ylabel="recall", ylim=(0, 1.02))
    axes[0].legend(fontsize=6, ncol=2)
    axes[1].set(title="precision per transform", xlabel="threshold (bits)", ylim=(0, 1.02))
    floor = 0.5 / (cal.n_images * (cal.n_images - 1))
    axes[2].semilogy(cal.thresholds, np.maximum(cal.overall_fmr, floor), "k-", lw=2.5, label="distinct pairs")
    axes[2].axhline(TARGET_FMR, color="grey", ls=":", label="target 1e-4")
    axes[2].set(title=f"false-match rate ({cal.n_images} images)", xlabel="threshold (bits)")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.axvline(default, color="red", ls="--", lw=1)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _write(cal: Calibration, out: Path, label: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(dataclasses.asdict(cal), indent=1))
    text = cal.table()
    if DEFAULT_THRESHOLD in cal.thresholds:
        text += "\n\n" + cal.transform_table(DEFAULT_THRESHOLD)
    (out / "calibration.txt").write_text(f"{label}\n{text}\n")
    return plot(cal, out / "calibration.png")


def run(out_dir: str | os.PathLike, *, source: str | None = None, holdout: bool = False,
        holdout_photos: Iterable[str] = HOLDOUT_PHOTOS, repeats: int = 4,
        log_mlflow: bool = True) -> dict[str, Calibration]:
    """Calibrate on ``source`` (any test-set source) or the bundled photo pool; write JSON, tables and PNGs.

    With ``holdout`` the pool is split by source photograph (:func:`split_pool`):
    the design part suggests a threshold, the held-out part measures the rule at
    ``DEFAULT_THRESHOLD`` on photos the detector was not tuned on. Returns
    ``{"all": cal}`` or ``{"design": cal, "holdout": cal}``.
    """
    if source and holdout:
        raise ValueError(f"--holdout splits the bundled photo pool by source photograph; with --source {source!r}, "
                         "calibrate a held-out source of your own instead (a second run with --source)")
    if source:
        sets = {"all": [item.image for item in iter_images(source) if item.image is not None]}
        groups = {"all": None}
    else:
        pool = photo_pool()
        if holdout:
            design, held = split_pool(pool, holdout_photos)
            sets = {"design": [img for _, img in design], "holdout": [img for _, img in held]}
            groups = {"design": [n.split("@")[0] for n, _ in design], "holdout": [n.split("@")[0] for n, _ in held]}
        else:
            sets = {"all": [img for _, img in pool]}
            groups = {"all": [n.split("@")[0] for n, _ in pool]}
    out = Path(out_dir)
    cals, pngs = {}, {}
    for name, images in sets.items():
        cals[name] = calibrate(images, repeats=repeats, groups=groups[name])
        pngs[name] = _write(cals[name], out / name if len(sets) > 1 else out, f"{name}: {len(images)} images")
    low = low_texture_report([img for images in sets.values() for img in images])
    (out / "low_texture.json").write_text(json.dumps(low, indent=1))
    if log_mlflow:
        params = {"images": {k: c.n_images for k, c in cals.items()}, "source": source or "photo_pool",
                  "holdout": holdout, "default_threshold": DEFAULT_THRESHOLD}
        with tracking.start_run("dedup-calibration", params=params, tags=tracking.run_tags(params),
                                run_name=f"dedup calibration on {source or 'photo_pool'}"):
            for name, cal in cals.items():
                for i, t in enumerate(cal.thresholds):
                    tracking.log_metrics({f"{name}.recall": cal.overall_recall[i], f"{name}.fmr": cal.overall_fmr[i]},
                                         step=t)
                if DEFAULT_THRESHOLD in cal.thresholds:
                    tracking.log_metrics({f"{name}.default.{k}": v for k, v in cal.at(DEFAULT_THRESHOLD).items()})
                tracking.log_artifact(pngs[name])
                tracking.log_artifact(pngs[name].with_suffix(".json"))
    return cals


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for calibration.json/.txt/.png")
    parser.add_argument("--source", default=None, help="images to calibrate on (any test-set source); default: bundled photos")
    parser.add_argument("--holdout", action="store_true",
                        help="split the bundled photos by source photograph into design and held-out parts")
    parser.add_argument("--holdout-photos", default=",".join(HOLDOUT_PHOTOS),
                        help="comma-separated source photos for the held-out part")
    parser.add_argument("--repeats", type=int, default=4, help="samples per image of each random transform")
    parser.add_argument("--no-mlflow", action="store_true")
    args = parser.parse_args(argv)
    try:
        cals = run(args.out, source=args.source, holdout=args.holdout,
                   holdout_photos=[p for p in args.holdout_photos.split(",") if p], repeats=args.repeats,
                   log_mlflow=not args.no_mlflow)
    except ValueError as exc:
        parser.error(str(exc))
    for name, cal in cals.items():
        print(f"== {name}: {cal.n_images} images")
        print(cal.table())
        if DEFAULT_THRESHOLD in cal.thresholds:
            print(cal.transform_table(DEFAULT_THRESHOLD))
    print("low texture:", (Path(args.out) / "low_texture.json").read_text())
    first = cals.get("design", cals.get("all"))
    print(f"chosen threshold (FMR <= {TARGET_FMR / 5:g} on {'design' if 'design' in cals else 'all'} images): "
          f"{first.choose_threshold()}; default {DEFAULT_THRESHOLD}")


if __name__ == "__main__":
    main()
