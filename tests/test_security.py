"""Security defaults that hold for the whole tree: nothing read from storage is unpickled.

Checkpoints are safetensors, training state is tensors and plain types loaded with
``weights_only=True``, and MLflow models are loaded from code, not from a pickled object. A
checkpoint or state file on shared storage is therefore data, never code: a file planted
there by someone else cannot run anything when a job reads it.

The static check reads every module of the project (function-local calls included), so a
new ``torch.load`` without ``weights_only=True`` or a new ``pickle.load`` fails here before
it ships. Pickling *to send objects between processes* (Beam, Ray) is not reading storage
and is not checked.
"""
from __future__ import annotations

import ast
import os
import pickle
from pathlib import Path

import pytest
import torch

import vitcore

REPO = Path(__file__).resolve().parents[1]
PROJECT = ("common", "vitcore", "dedup", "pipelines", "training", "transfer", "demo", "reports", "jobs", "benchmarks",
           "infra")
# Reads that unpickle by design, each with the reason it is no wider a door than what already stands open.
KNOWN = {
    # Tune's grid state (basic-variant-state-*.json) is a pickle by Tune's own design, and Tune's
    # Tuner.restore loads the same file: whoever can write the sweep folder can already run code.
    ("transfer/tune_state.py", "cloudpickle.load"),
}

# Calls that turn bytes from a file into arbitrary objects.
UNPICKLING = {
    "pickle.load", "pickle.loads", "cloudpickle.load", "cloudpickle.loads", "dill.load", "dill.loads",
    "joblib.load", "pandas.read_pickle", "pd.read_pickle", "torch.serialization.load",
    "mlflow.pytorch.load_model", "mlflow.sklearn.load_model",
}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def unsafe_loads(source: str, filename: str) -> list[str]:
    """Every call in ``source`` that could unpickle what it reads, as 'file:line: call'."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        where = f"{filename}:{node.lineno}: {name}"
        if name in UNPICKLING:
            found.append(where)
        elif name == "torch.load":
            flag = _keyword(node, "weights_only")
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                found.append(where + " without weights_only=True")
        elif name in ("np.load", "numpy.load"):
            flag = _keyword(node, "allow_pickle")
            if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False):
                found.append(where + " with allow_pickle")
    return found


def project_files() -> list[Path]:
    return sorted(p for top in PROJECT if (REPO / top).is_dir() for p in (REPO / top).rglob("*.py"))


def test_no_project_module_unpickles_what_it_reads():
    files = project_files()
    assert len(files) > 50
    found = [hit for p in files for hit in unsafe_loads(p.read_text(), str(p.relative_to(REPO)))
             if (hit.split(":")[0], hit.rsplit(": ", 1)[1]) not in KNOWN]
    assert not found, "unpickling loads (use safetensors, or torch.load(..., weights_only=True)):\n" + "\n".join(found)


def test_the_static_check_sees_what_it_must():
    src = (
        "import pickle, torch, numpy as np\n"
        "def f(p):\n"
        "    torch.load(p)\n"
        "    torch.load(p, weights_only=False)\n"
        "    torch.load(p, map_location='cpu', weights_only=True)\n"
        "    pickle.loads(b'')\n"
        "    np.load(p, allow_pickle=True)\n"
        "    np.load(p)\n"
    )
    hits = unsafe_loads(src, "x.py")
    assert [h.split(": ", 1)[0] for h in hits] == ["x.py:3", "x.py:4", "x.py:6", "x.py:7"], hits


class _Payload:
    """Unpickling this writes a marker file: the proof that a load ran code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_pickle_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    planted = tmp_path / "model.safetensors"
    planted.write_bytes(pickle.dumps({"weights": _Payload(str(marker))}))
    torch.save({"step": 1, "evil": _Payload(str(marker))}, tmp_path / "train_state.pt")

    with pytest.raises(ValueError, match="not a readable safetensors checkpoint"):
        vitcore.load_checkpoint(planted)
    # What pre-training's resume does with its state file:
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(tmp_path / "train_state.pt", map_location="cpu", weights_only=True)
    assert not marker.exists()
    # The payload is real: an unguarded load would have run it.
    torch.load(tmp_path / "train_state.pt", weights_only=False)
    assert marker.exists()
    os.remove(marker)
