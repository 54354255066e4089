"""Reports of a de-duplication pass: per-test-set counts, the match list, an audit contact sheet.

BiT (Kolesnikov et al. 2020, Table 7) reports how many near-duplicates of each
test set it found in JFT; ``counts_table`` prints ours the same way. Its figure
shows rare false positives, which is why the borderline pairs (distance closest
to the threshold) get a contact sheet for a person to audit.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from PIL import Image, ImageDraw

# One matched corpus row (the removed.jsonl row): key and source (the corpus file's uri), test_set,
# matched_key and test_uri (the test file's uri), distance, exact, direction.
MatchRow = Mapping[str, object]


def counts(matches: Iterable[MatchRow], test_sets: Iterable[str]) -> dict[str, int]:
    out = {name: 0 for name in test_sets}
    for m in matches:
        out[str(m["test_set"])] = out.get(str(m["test_set"]), 0) + 1
    return out


def counts_table(match_counts: Mapping[str, int], test_images: Mapping[str, int], corpus_images: int) -> str:
    """Markdown table in the style of BiT's Table 7: near-duplicates found per test set."""
    lines = ["| test set | test images | corpus images matched | share of corpus |", "|---|---:|---:|---:|"]
    for name in sorted(set(match_counts) | set(test_images)):
        n = match_counts.get(name, 0)
        share = n / corpus_images if corpus_images else 0.0
        lines.append(f"| {name} | {test_images.get(name, 0):,} | {n:,} | {share:.4%} |")
    lines.append(f"| total | {sum(test_images.values()):,} | {sum(match_counts.values()):,} | "
                 f"{(sum(match_counts.values()) / corpus_images if corpus_images else 0):.4%} |")
    return "\n".join(lines)


def pick_for_audit(matches: Sequence[MatchRow], *, closest: int = 8, borderline: int = 8) -> tuple[list, list]:
    """The ``closest`` lowest-distance pairs and the ``borderline`` highest-distance ones (no overlap)."""
    ordered = sorted(matches, key=lambda m: (int(m["distance"]), str(m["key"])))
    low = ordered[:closest]
    high = [m for m in ordered[::-1][:borderline] if m not in low][::-1]
    return low, high


def _tail(uri: object, width: int = 40) -> str:
    """The end of a uri (its file name first), cut to fit the caption column."""
    text = str(uri or "(uri not recorded)")
    return text if len(text) <= width else "..." + text[-(width - 3):]


def caption(m: MatchRow, label: str, threshold: int) -> str:
    """A contact-sheet caption: the distance, then each side by key and by the file it came from."""
    return (f"{label}: d={m['distance']}/{threshold}{' exact' if m.get('exact') else ''}"
            f"{' ' + str(m['direction']) if m.get('direction') else ''}\n"
            f"corpus {m['key']}\n  {_tail(m.get('source'))}\n"
            f"{m['test_set']}/{m['matched_key']}\n  {_tail(m.get('test_uri'))}")


def contact_sheet(rows: Sequence[tuple[Image.Image | None, Image.Image | None, str]], path: str | os.PathLike,
                  *, title: str = "", cell: int = 128) -> Path:
    """A PNG of (corpus image, test image, caption) rows for a person to audit; missing images are grey."""
    pad, text_h = 6, 14
    width = 2 * cell + 3 * pad + 260
    height = text_h + pad + max(1, len(rows)) * (cell + pad) + pad
    sheet = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    draw.text((pad, 2), title, fill=(0, 0, 0))
    for i, (corpus, test, caption) in enumerate(rows):
        y = text_h + pad + i * (cell + pad)
        for j, img in enumerate((corpus, test)):
            x = pad + j * (cell + pad)
            if img is None:
                draw.rectangle((x, y, x + cell, y + cell), fill=(200, 200, 200))
                draw.text((x + 4, y + cell // 2), "unavailable", fill=(0, 0, 0))
                continue
            thumb = img.convert("RGB")
            thumb.thumbnail((cell, cell))
            sheet.paste(thumb, (x + (cell - thumb.width) // 2, y + (cell - thumb.height) // 2))
        draw.text((2 * cell + 3 * pad, y + 4), caption, fill=(0, 0, 0))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out)
    return out


def write_report(out_dir: str | os.PathLike, matches: Sequence[MatchRow], *, test_images: Mapping[str, int],
                 corpus_images: int, threshold: int,
                 load_corpus: Callable[[str], Image.Image | None],
                 load_test: Callable[[str, str], Image.Image | None]) -> dict[str, Path]:
    """Write ``counts.md``, ``counts.json``, ``matches.jsonl`` and ``contact_sheet.png`` under ``out_dir``.

    ``load_corpus(key)`` and ``load_test(test_set, key)`` fetch the pixels of the
    audited pairs only; returning None draws a grey cell instead of failing.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per_set = counts(matches, test_images)
    (out / "counts.md").write_text(counts_table(per_set, test_images, corpus_images) + "\n")
    (out / "counts.json").write_text(json.dumps({"matched": per_set, "test_images": dict(test_images),
                                                 "corpus_images": corpus_images, "threshold": threshold}, indent=2))
    with open(out / "matches.jsonl", "w") as f:
        for m in sorted(matches, key=lambda m: (str(m["test_set"]), int(m["distance"]), str(m["key"]))):
            f.write(json.dumps(dict(m)) + "\n")
    low, high = pick_for_audit(matches)
    rows = []
    for label, group in (("closest", low), ("borderline", high)):
        for m in group:
            rows.append((load_corpus(str(m["key"])), load_test(str(m["test_set"]), str(m["matched_key"])),
                         caption(m, label, threshold)))
    sheet = contact_sheet(rows, out / "contact_sheet.png",
                          title=f"{len(matches)} matches; left corpus, right test image; threshold {threshold}")
    return {"counts": out / "counts.md", "matches": out / "matches.jsonl", "contact_sheet": sheet}
