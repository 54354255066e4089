"""Every figure the stages and the report draw, as PNG bytes: matplotlib on the Agg backend.

One figure per concept, drawn for any number of runs; a stage's own plot of its run is the
report's figure given that one run. Each series carries a label (``label`` in an entry, or
the first item of a pair) that becomes its legend entry. matplotlib is imported inside
:func:`pyplot`: it is heavy, and most of the project never draws.
"""
from __future__ import annotations

import io
import math
import re
from pathlib import Path

GROUP_COLOURS = {"natural": "#4c72b0", "specialized": "#dd8452", "structured": "#55a868"}


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, with ``$`` in text taken literally.

    Labels are run names, which users choose; mathtext would fail the whole figure on a name
    with an unbalanced ``$``.
    """
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    pyplot().close(fig)
    return buf.getvalue()


def write(data: bytes, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def colours(n: int) -> list:
    cmap = pyplot().get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def _words(label: str, what: str) -> str:
    return f"{label} {what}".strip()


# Keys of a pre-training history, the panel each goes to and its line style, marker and legend word.
_CURVES = {
    "train_loss": ("loss", "-", None, "train"),
    "holdout_loss": ("loss", "--", None, "held-out"),
    "holdout_accuracy": ("accuracy", "-", "o", "held-out"),
    "train_accuracy": ("accuracy", ":", "s", "train"),
    "lr": ("learning rate", "-", None, ""),
    "images_per_second": ("images / s (all workers)", "-", None, ""),
}
_PANELS = ("loss", "accuracy", "learning rate", "images / s (all workers)")


def _curve_style(key: str) -> tuple[str, str, str | None, str] | None:
    if key in _CURVES:
        return _CURVES[key]
    if key.startswith("fewshot_") and key.endswith("_accuracy"):
        return "accuracy", "--", "^", key[len("fewshot_"):-len("_accuracy")] + " few-shot"
    return None


def pretrain_curves(runs: list[tuple[str, dict[str, list[tuple[int, float]]]]], title: str = "") -> bytes | None:
    """Loss, accuracy (held-out, train, few-shot), learning rate and images/s against the step, one
    colour per run; ``runs`` are (label, {metric: [(step, value)]}) pairs. None when nothing was logged."""
    panels = [p for p in _PANELS if any(points and (_curve_style(k) or ("",))[0] == p
                                        for _, history in runs for k, points in history.items())]
    if not panels:
        return None
    plt = pyplot()
    cols = 2 if len(panels) == 4 else len(panels)
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 4.0 * rows), squeeze=False)
    ax_of = dict(zip(panels, axes.flat))
    for colour, (label, history) in zip(colours(len(runs)), runs):
        for key, points in history.items():
            style = _curve_style(key)
            if not points or style is None:
                continue
            panel, line, marker, what = style
            steps, values = zip(*points)
            ax_of[panel].plot(steps, values, color=colour, linestyle=line, marker=(marker or "o") if len(steps) < 20 else None,
                              markersize=4, label=_words(label, what) or key)
    for panel, ax in ax_of.items():
        ax.set_title(panel.split(" (")[0])
        ax.set_xlabel("step")
        ax.set_ylabel(panel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    if "accuracy" in ax_of:
        ax_of["accuracy"].set_ylim(0, 1.02)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return png(fig)


def finetune_by_lr(entries: list[dict], title: str) -> bytes | None:
    """Val (solid) and test (dashed) accuracy of each selection trial against its learning rate; the
    selected rate circled and the final model's test accuracy as a star. An entry holds ``label``,
    ``trials`` (``lr``, ``val_accuracy``, ``test_accuracy``), ``selected_lr`` and ``test_accuracy``."""
    entries = [e for e in entries if any(t.get("val_accuracy") is not None for t in e["trials"])]
    if not entries:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for colour, e in zip(colours(len(entries)), entries):
        rows = [t for t in e["trials"] if t.get("val_accuracy") is not None]
        lrs = [t["lr"] for t in rows]
        ax.plot(lrs, [t["val_accuracy"] for t in rows], "-o", color=colour,
                label=_words(e["label"], "val: selects the rate"))
        tests = [(t["lr"], t["test_accuracy"]) for t in rows if t.get("test_accuracy") is not None]
        if tests:
            ax.plot(*zip(*tests), "--x", color=colour, alpha=0.7, label=_words(e["label"], "test (not used to choose)"))
        sel = e.get("selected_lr")
        if sel is not None:
            val = next((t["val_accuracy"] for t in rows if math.isclose(t["lr"], sel)), None)
            if val is not None:
                ax.plot([sel], [val], "o", markersize=14, markerfacecolor="none", markeredgecolor=colour)
            if e.get("test_accuracy") is not None:
                ax.plot([sel], [e["test_accuracy"]], "*", markersize=13, color=colour,
                        label=_words(e["label"], f"retrained at lr {sel:g}: test {e['test_accuracy']:.3f}"))
    lrs = sorted({t["lr"] for e in entries for t in e["trials"]})
    if all(lr > 0 for lr in lrs):
        ax.set_xscale("log")
        ax.minorticks_off()
    ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs])
    ax.set_xlabel("learning rate")
    ax.set_ylabel("top-1 accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return png(fig)


def vtab_bars(entries: list[dict], title: str = "VTAB: test accuracy per task (dashed: group means)") -> bytes | None:
    """Test accuracy per task, grouped by VTAB group, one bar per run; dashed lines are group means.
    An entry holds ``label``, ``tasks`` ({name: {group, test_accuracy}}), ``groups`` and ``mean``."""
    if not entries:
        return None
    plt = pyplot()
    tasks = []
    for g in list(GROUP_COLOURS) + ["?"]:
        for e in entries:
            tasks += [n for n, t in e["tasks"].items() if t["group"] == g and n not in tasks]
    width = 0.8 / len(entries)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(tasks) * max(1, len(entries) / 2) + 3), 4.5))
    for i, (colour, e) in enumerate(zip(colours(len(entries)), entries)):
        xs = [k + (i - (len(entries) - 1) / 2) * width for k, n in enumerate(tasks) if n in e["tasks"]]
        ys = [e["tasks"][n]["test_accuracy"] or 0.0 for n in tasks if n in e["tasks"]]
        ax.bar(xs, ys, width=width, color=colour, label=_words(e["label"], f"(mean {e['mean']:.3f})")
               if e.get("mean") is not None else e["label"])
        for g, m in e.get("groups", {}).items():
            idx = [k for k, n in enumerate(tasks) if e["tasks"].get(n, {}).get("group") == g]
            if idx and m is not None:
                ax.hlines(m, min(idx) - 0.45, max(idx) + 0.45, colors=[colour], linestyles="--")
    ax.set_xticks(range(len(tasks)),
                  [f"{n}\n({next(e['tasks'][n]['group'] for e in entries if n in e['tasks'])})" for n in tasks],
                  fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("test top-1 accuracy")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return png(fig)


def dedup_bars(rows: list[dict], test_sets: list[str]) -> bytes | None:
    """Images removed per test set by each prepare and dedup run; a row holds ``label`` and ``counts``
    ({test set: images})."""
    rows = [r for r in rows if r["counts"]]
    if not rows or not test_sets:
        return None
    plt = pyplot()
    width = 0.8 / max(1, len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(test_sets) + 0.3 * len(rows) + 3), 4.0))
    for i, (colour, r) in enumerate(zip(colours(len(rows)), rows)):
        xs = [k + (i - (len(rows) - 1) / 2) * width for k in range(len(test_sets))]
        ys = [r["counts"].get(t, 0) for t in test_sets]
        bars = ax.bar(xs, ys, width=width, color=colour, label=r["label"])
        ax.bar_label(bars, fontsize=7)
    ax.set_xticks(range(len(test_sets)), test_sets)
    ax.set_ylabel("corpus images removed")
    ax.set_title("near-duplicates of each test set removed")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return png(fig)


# The paper's three model families (Figure 5), told apart by the variant's name as vitcore decodes it.
FAMILY_MARKERS = {"ViT": "o", "ResNet": "s", "hybrid": "^"}


def model_family(model: str) -> str:
    """``ResNet`` for a BiT ResNet (``BiT-R50x1``), ``hybrid`` for a ResNet stem under a ViT (``R50+B/16``), else ``ViT``."""
    if model.startswith("BiT-"):
        return "ResNet"
    return "hybrid" if "+" in model else "ViT"


#: A study table's few-shot column: ``<k>shot_accuracy``, or ``<task>_<k>shot_accuracy`` for a ``--task``.
SHOT_COLUMN = re.compile(r"(?:(.+)_)?(\d+)shot_accuracy")


def shot_keys(rows: list[dict]) -> list[str]:
    """A study table's scored few-shot columns, by task (none first), then shot count."""
    keys = {k for r in rows for k, v in r.items() if SHOT_COLUMN.fullmatch(k) and v is not None}
    return sorted(keys, key=lambda k: (SHOT_COLUMN.fullmatch(k).group(1) or "", int(SHOT_COLUMN.fullmatch(k).group(2))))


def shot_name(key: str) -> str:
    """``tiny 5-shot`` for ``tiny_5shot_accuracy``, ``5-shot`` for ``5shot_accuracy``."""
    task, k = SHOT_COLUMN.fullmatch(key).groups()
    return f"{task + ' ' if task else ''}{k}-shot"


def _study_axes(rows: list[dict], title: str):
    """One panel per shot count that any cell scored; None when no cell has a few-shot score."""
    shots = shot_keys(rows)
    if not shots:
        return None, None, shots
    plt = pyplot()
    from matplotlib import ticker

    cols = 2 if len(shots) == 4 else min(len(shots), 3)
    rows = (len(shots) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols + 1.5, 4.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, shots):
        ax.set_title(f"{shot_name(key)} linear", fontsize=10)
        ax.set_ylabel(f"best {shot_name(key)} accuracy")
        ax.set_xscale("log")
        # Plain tick labels: the default ones are mathtext, which pyplot() turns off.
        ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.grid(alpha=0.3, which="both")
    for ax in list(axes.flat)[len(shots):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    return fig, list(axes.flat), shots


def study_by_images(rows: list[dict], title: str = "best few-shot accuracy against pre-training images") -> bytes | None:
    """Figure 4: each model's best few-shot accuracy against its training images, one line per model,
    log x axis, one panel per shot count. ``rows`` are a study table's (``model``, ``images``, ``<k>shot_accuracy``)."""
    return _study_figure(rows, title, "images", "pre-training images (training rows of the subset)",
                         {"linestyle": "-"})


def study_by_compute(rows: list[dict], title: str = "best few-shot accuracy against pre-training compute") -> bytes | None:
    """Figure 5: each cell's best few-shot accuracy against its exaFLOPs, the marker its family (ViT,
    ResNet, hybrid) and the colour its model, log x axis, one panel per shot count. Rows without
    exaFLOPs (a table rebuilt from a stopped study's cells) are left out."""
    return _study_figure(rows, title, "exaflops", "pre-training exaFLOPs", {"linestyle": "none", "markersize": 8})


def _study_figure(rows: list[dict], title: str, x: str, xlabel: str, style: dict) -> bytes | None:
    """Each model's best few-shot accuracy against column ``x``, a panel per shot count, marked by family."""
    rows = [r for r in rows if r.get(x)]
    fig, axes, shots = _study_axes(rows, title)
    if fig is None:
        return None
    models = list(dict.fromkeys(r["model"] for r in rows))
    for ax, key in zip(axes, shots):
        for colour, model in zip(colours(len(models)), models):
            points = sorted((r[x], r[key]) for r in rows if r["model"] == model and r.get(key) is not None)
            if points:
                ax.plot(*zip(*points), marker=FAMILY_MARKERS[model_family(model)], color=colour,
                        label=f"{model} ({model_family(model)})", **style)
        ax.set_xlabel(xlabel)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return png(fig)
