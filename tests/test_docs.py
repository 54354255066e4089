"""Every relative link in the README, the manual (docs/) and benchmarks/README.md resolves.

A link names a file or folder that exists, and its anchor (``#...``), if any, names a heading of
that file by GitHub's slug rules. Web (``http(s)://``) and ``mailto:`` links are not checked.
The manual says what a user needs, and no text in the tree cites a tracker number or a dated
work session in place of the fact it stood for.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s{0,3}(```|~~~)")
INLINE_CODE = re.compile(r"(`+).*?\1")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]


def _prose_lines(text: str):
    """The lines outside fenced code blocks, with their line numbers."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower-case, punctuation other than - and _ dropped, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return "".join(ch for ch in text if ch.isalnum() or ch in "-_ ").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path):
    """(line number, target) of every link in ``path``'s prose, inline code excluded."""
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        ref = REFERENCE.match(line)
        if ref:
            yield number, ref.group(1)
            continue
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            yield number, m.group(1)


def broken_links(path: Path) -> list[str]:
    """Every relative link of ``path`` that names a missing file or heading, as 'file:line: target (why)'."""
    problems = []
    for number, target in links(path):
        if re.match(r"^(https?:|mailto:)", target, re.IGNORECASE):
            continue
        where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{where} (no such file: {dest})")
        elif anchor and (dest.is_dir() or dest.suffix != ".md" or anchor not in anchors(dest)):
            problems.append(f"{where} (no heading #{anchor} in {dest.name})")
    return problems


def test_every_relative_link_in_the_docs_resolves():
    files = doc_files()
    assert all(f.is_file() for f in files) and len(files) >= 10
    problems = [p for f in files for p in broken_links(f)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_a_missing_file_or_heading_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Scale-out: Ray, Dask & MLflow\n\n## Ports\n\n## Ports\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n"
        "[ok](other.md) [ok](other.md#scale-out-ray-dask--mlflow) [ok](other.md#ports-1) [ok](#a-page)\n"
        "[web](https://example.com/missing.md#x) [mail](mailto:someone@example.com) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
        "[gone](missing.md)\n"
        "[bad anchor](other.md#scale-out)\n"
        "[ref]: ./also-missing.md\n"
    )
    problems = broken_links(page)
    assert len(problems) == 3, problems
    assert ":7: missing.md (no such file" in problems[0]
    assert ":8: other.md#scale-out (no heading #scale-out in other.md)" in problems[1]
    assert ":9: ./also-missing.md (no such file" in problems[2]


# What a first-time user ran into before the manual said it: each fact, the file that says it, and
# words it is said in.
FACTS = {
    "the manifest's columns": ("docs/ingest.md", ["The image column is `uri`", "`label`", "`labels`"]),
    "how each stage resumes": ("docs/README.md", ["Each stage is resumed by running the same command again",
                                                  "`pretrain_run.json`, no `--run-name` needed"]),
    "submit from the repository root, outputs outside it": (
        "docs/scale-out.md", ["**Submit from the repository root.**", "100 MiB", "status code 413",
                              "keep shard sets, models and other outputs outside the repository"]),
    "VITSCALE_HOME and a relative --output on a local run": (
        "docs/tracking.md", ["On a local run `VITSCALE_HOME` moves the MLflow store only: a relative `--output` "
                             "stays relative"]),
    "ties in the learning-rate selection": ("docs/transfer.md", ["a tie goes to the lowest rate"]),
    "a cluster's VITSCALE_HOME reaches submitted jobs": (
        "docs/scale-out.md", ["**`VITSCALE_HOME` from the cluster.**", "gives it to every job"]),
}


def test_the_manual_says_what_a_user_needs_before_they_hit_it():
    missing = []
    for fact, (name, phrases) in FACTS.items():
        text = " ".join((REPO / name).read_text().split())  # lines rewrapped: compare word by word
        missing += [f"{name}: {fact}: {p!r}" for p in phrases if " ".join(p.split()) not in text]
    assert not missing, "\n".join(missing)


# An issue number of the tracker, or a work session by number or as the last, this or the next
# one: a reader cannot look these up. Ray's session folders (session_latest, session_2026-...) and
# a Ray, pytest or process session are not matched.
EPISODE = re.compile(r"\bissues?[ -]#?\d+|\bsessions? \d+|\b(?:last|this|next|previous|earlier) session\b",
                     re.IGNORECASE)
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".example"}
TEXT_NAMES = {"Makefile", "Dockerfile", "run"}
NOT_SOURCE = {"__pycache__", "mlruns", "node_modules"}


def source_files(root: Path):
    """The tree's text files, without hidden folders (but ``.ci``), caches and the stages' outputs."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not ((d.startswith(".") and d != ".ci") or d in NOT_SOURCE
                                                 or d.endswith(("_output", ".egg-info"))))
        for name in sorted(files):
            path = Path(folder) / name
            if path.suffix in TEXT_SUFFIXES or name in TEXT_NAMES:
                yield path


def episodes(root: Path) -> list[str]:
    """'file:line: words' for every tracker number or dated session under ``root``."""
    found = []
    for path in source_files(root):
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            found += [f"{path.relative_to(root)}:{number}: {m.group(0)}" for m in EPISODE.finditer(line)]
    return found


def test_the_tree_states_facts_not_tracker_numbers_or_dated_sessions():
    found = episodes(REPO)
    assert not found, "say the fact the reference stood for instead:\n" + "\n".join(found)


def test_a_tracker_number_or_dated_session_is_reported_and_a_ray_session_is_not(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(f"# fixed in issue {24}\nx = 1  # see Issues {5} and {15}\n")
    (tmp_path / "notes.md").write_text(f"Measured in session {12}, code abc.\nAs the {'Last'} Session found.\n"
                                       "Logs in /tmp/ray/session_latest, deleted with the Ray session.\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "lib.py").write_text(f"# issue {1}\n")
    assert episodes(tmp_path) == [f"notes.md:1: session {12}", f"notes.md:2: {'Last'} Session",
                                  f"pkg/mod.py:1: issue {24}", f"pkg/mod.py:2: Issues {5}"]
