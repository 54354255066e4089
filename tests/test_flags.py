"""Every flag a message of the project names exists.

A message that tells a user to pass ``--label-mode`` when no entrypoint takes it sends them to a
dead end. The flags named in string literals outside docstrings, in the packages and ``jobs/``, must
each be a flag of one of the entrypoints (their configs' fields, the console flags, or an
``add_argument`` literal), or a flag of another program the message quotes, listed below with it.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

from common.config import build_parser

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "vitcore", "neardup", "pipelines", "dedup", "training", "transfer", "reports", "demo", "jobs")
# A flag: two dashes, lower-case words joined by single dashes, and no underscore after it (Beam's
# pipeline options, such as --direct_num_workers, are passed through to Beam as they are).
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?![\w])")
# Flags of other programs that messages quote, each with the program.
OTHER_PROGRAMS = {
    "backend-store-uri": "mlflow ui", "host": "mlflow ui", "port": "mlflow ui",
    "porcelain": "git status", "untracked-files": "git status",
    "runtime-env-json": "ray job submit", "logdir": "tensorboard (a Ray line the console hides)",
    "project": "a Beam pipeline option in an example (--project=p)", "name": "the form of a Beam option (--name=value)",
    "x": "a matplotlib line style ('--x')",
}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def named_flags() -> dict[str, list[str]]:
    """Each flag named in a non-docstring string literal, with where."""
    found: dict[str, list[str]] = {}
    for top in PACKAGES:
        for path in sorted((REPO / top).rglob("*.py")) if (REPO / top).is_dir() else []:
            tree = ast.parse(path.read_text(), str(path))
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                    for m in FLAG.finditer(node.value):
                        found.setdefault(m.group(1), []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def _entrypoint_configs() -> list[type]:
    """The config class each ``jobs/*.py`` hands to ``run_job``."""
    out = []
    for path in sorted((REPO / "jobs").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        imported = {a.asname or a.name: node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run_job" and node.args:
                name = node.args[0].id
                out.append(getattr(importlib.import_module(imported[name]) if name in imported else _load(path), name))
    return out


def _load(path: Path):
    """A job file as a module (its ``__main__`` block does not run): for a config defined in the job."""
    spec = importlib.util.spec_from_file_location(f"_job_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def existing_flags() -> set[str]:
    flags = set()
    for cls in _entrypoint_configs():
        for action in build_parser(cls, console=True)._actions:
            flags.update(s[2:] for s in action.option_strings if s.startswith("--"))
    for top in PACKAGES:
        for path in sorted((REPO / top).rglob("*.py")) if (REPO / top).is_dir() else []:
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                    flags.update(a.value[2:] for a in node.args
                                 if isinstance(a, ast.Constant) and str(a.value).startswith("--"))
    return flags


def test_every_flag_a_message_names_exists():
    assert len(_entrypoint_configs()) >= 9  # prepare, dedup, pretrain, finetune, vtab, vtab_prepare, fewshot, report, demo
    exists = existing_flags() | set(OTHER_PROGRAMS)
    missing = {flag: where for flag, where in named_flags().items() if flag not in exists}
    assert not missing, f"messages name flags no entrypoint takes: {missing}"


def test_the_check_sees_a_made_up_flag():
    tree = ast.parse('raise ValueError("set --label-mode multi")')
    flags = [m.group(1) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             for m in FLAG.finditer(n.value)]
    assert flags == ["label-mode"] and "label-mode" not in existing_flags()
