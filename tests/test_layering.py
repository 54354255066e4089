"""The layers of the tree, read from the imports of every module (function-local ones too).

From the bottom up (README, "Layout"):
    common/        base: configs, the CLI runner, text rules, filesystem and atomic writes, MLflow
    vitcore/       the model; imports nothing of the project
    neardup/       near-duplicate signatures, the match rule and the test-set index, which the ingest uses
    pipelines/     the Beam ingest, the shard schema and readers
    dedup/         the re-checking job and the calibration: read corpora and shard sets through pipelines
    training/      pre-training: the trainer, checkpoints, metrics, loaders, the loop's pieces, and
                   the Ray and MLflow-model helpers both stages use
    transfer/      fine-tuning, VTAB-1k and few-shot: the SGD loop, the Tune sweeps and the VTAB tasks
    reports/       the comparison report: reads the MLflow store the stages wrote
    demo/          the end-to-end demo and its generated data (it ends with a report)
    jobs/ benchmarks/ infra/   entrypoints and tools
A module may import its own package and anything of a lower layer; vitcore and common import
only themselves. No two modules may import each other, directly or round a longer loop.

The stages share parts and do not stack (STYLE.md): no stage imports another stage's module. The
shared parts (transfer's sgd, sweep and VTAB registry and task folders; training's loop, data, Ray
and MLflow helpers) belong to no stage.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = ("common", "vitcore", "neardup", "dedup", "pipelines", "training", "transfer", "reports", "demo", "jobs",
           "benchmarks", "infra")
LAYER = {"common": 0, "vitcore": 0, "neardup": 1, "pipelines": 2, "dedup": 3, "training": 4, "transfer": 5,
         "reports": 6, "demo": 7, "jobs": 8, "benchmarks": 8, "infra": 8}
SELF_CONTAINED = {"common", "vitcore"}
# Pre-training's own components count as pre-training's wherever they exist.
STAGE = {"training.pretrain": "pretrain", "training.trainer": "pretrain", "training.checkpointer": "pretrain",
         "training.metrics": "pretrain", "transfer.finetune": "finetune", "transfer.vtab": "vtab",
         "transfer.fewshot": "fewshot"}


def layer_of(module: str) -> str:
    return module.split(".")[0]


def module_names() -> dict[str, Path]:
    out = {}
    for top in PROJECT:
        for path in (REPO / top).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """Project modules ``name`` imports anywhere in its file."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the submodule when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    names = module_names()
    known = set(names)
    return {name: imports_of(path, name, known) for name, path in names.items()}


def back_edges(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in graph.items():
        for dst in targets:
            ls, ld = layer_of(src), layer_of(dst)
            if ls == ld:
                continue
            if ls in SELF_CONTAINED or LAYER[ld] >= LAYER[ls]:
                bad.append(f"{src} -> {dst} ({ls} may not import {ld})")
    return sorted(bad)


def stage_edges(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in graph.items():
        for dst in targets:
            s, d = STAGE.get(src), STAGE.get(dst)
            if s and d and s != d:
                bad.append(f"{src} -> {dst} (the {s} stage may not import the {d} stage; share the part instead)")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_import_runs_down_the_layers():
    assert back_edges(import_graph()) == []


def test_no_module_import_cycles():
    assert cycles(import_graph()) == []


def test_no_training_stage_imports_another():
    assert stage_edges(import_graph()) == []


def test_every_module_belongs_to_a_layer():
    assert {layer_of(m) for m in import_graph()} <= set(LAYER)


def test_the_checks_catch_a_back_edge_and_a_cycle():
    graph = import_graph()
    graph["common.config"] = graph["common.config"] | {"pipelines.schema"}
    graph["neardup.index"] = graph["neardup.index"] | {"dedup.calibration"}
    assert "common.config -> pipelines.schema (common may not import pipelines)" in back_edges(graph)
    assert "neardup.index -> dedup.calibration (neardup may not import dedup)" in back_edges(graph)
    graph["training.pretrain"] = graph["training.pretrain"] | {"transfer.sweep"}
    assert "training.pretrain -> transfer.sweep (training may not import transfer)" in back_edges(graph)
    graph["pipelines.schema"] = graph["pipelines.schema"] | {"pipelines.ingest"}
    assert any({"pipelines.schema", "pipelines.ingest"} <= set(c) for c in cycles(graph))


def test_the_stage_check_catches_one_stage_standing_on_another():
    graph = import_graph()
    assert stage_edges(graph) == []
    graph["transfer.vtab"] = graph["transfer.vtab"] | {"transfer.finetune"}
    assert stage_edges(graph) == [
        "transfer.vtab -> transfer.finetune (the vtab stage may not import the finetune stage; share the part instead)"]
    assert back_edges(graph) == []  # a layer check alone would let it through
    graph["transfer.finetune"] = graph["transfer.finetune"] | {"transfer.sgd"}
    assert len(stage_edges(graph)) == 1  # a shared part is no stage


def test_function_local_imports_count(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from pipelines.ingest import run\n")
    assert imports_of(mod, "common.m", {"pipelines", "pipelines.ingest", "common.m"}) == {"pipelines.ingest"}
