"""The report's figures, as PNG bytes (matplotlib, Agg, like vitcore.inspection and training.vtab)."""
from __future__ import annotations

import io
import math

from reports.store import Run

GROUP_COLOURS = {"natural": "#4c72b0", "specialized": "#dd8452", "structured": "#55a868"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False  # run names and titles are text, never mathtext
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    plt = _plt()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _colours(n: int) -> list:
    plt = _plt()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def pretrain_curves(runs: list[Run], curves: dict[str, dict[str, list[tuple[int, float]]]]) -> bytes | None:
    """Loss, accuracy (held-out, train, few-shot) and images/s against the step, one colour per run."""
    if not any(curves.get(r.id) for r in runs):
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = {"holdout_accuracy": ("-", "o", "held-out"), "train_accuracy": (":", "s", "train")}
    for colour, run in zip(_colours(len(runs)), runs):
        c = curves.get(run.id, {})
        if c.get("train_loss"):
            steps, values = zip(*c["train_loss"])
            axes[0].plot(steps, values, color=colour, label=run.label)
        for key, points in c.items():
            if not points or not (key in styles or key.startswith("fewshot_")):
                continue
            line, marker, what = styles.get(key, ("--", "^", key[len("fewshot_"):-len("_accuracy")] + " few-shot"))
            steps, values = zip(*points)
            axes[1].plot(steps, values, color=colour, linestyle=line, marker=marker, markersize=4,
                         label=f"{run.label} {what}")
        if c.get("images_per_second"):
            steps, values = zip(*c["images_per_second"])
            axes[2].plot(steps, values, color=colour, label=run.label)
    for ax, title, ylabel in zip(axes, ("training loss", "accuracy", "throughput"),
                                 ("train_loss", "accuracy", "images / s (all workers)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    axes[1].set_ylim(0, 1.02)
    return _png(fig)


def finetune_by_lr(entries: list[dict], title: str) -> bytes | None:
    """Val (solid) and test (dashed) accuracy of each selection trial against its learning rate; the
    selected rate circled and the final model's test accuracy as a star."""
    entries = [e for e in entries if any(t.get("val_accuracy") is not None for t in e["trials"])]
    if not entries:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for colour, e in zip(_colours(len(entries)), entries):
        rows = [t for t in e["trials"] if t.get("val_accuracy") is not None]
        lrs = [t["lr"] for t in rows]
        ax.plot(lrs, [t["val_accuracy"] for t in rows], "-o", color=colour, label=f"{e['run'].label} val")
        tests = [(t["lr"], t["test_accuracy"]) for t in rows if t.get("test_accuracy") is not None]
        if tests:
            ax.plot(*zip(*tests), "--x", color=colour, alpha=0.7, label=f"{e['run'].label} test (not used to choose)")
        sel = e.get("selected_lr")
        if sel is not None:
            val = next((t["val_accuracy"] for t in rows if math.isclose(t["lr"], sel)), None)
            if val is not None:
                ax.plot([sel], [val], "o", markersize=14, markerfacecolor="none", markeredgecolor=colour)
            if e.get("test_accuracy") is not None:
                ax.plot([sel], [e["test_accuracy"]], "*", markersize=13, color=colour,
                        label=f"{e['run'].label} retrained at lr {sel:g}: test {e['test_accuracy']:.3f}")
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
    return _png(fig)


def vtab_bars(entries: list[dict]) -> bytes | None:
    """Test accuracy per task, grouped by VTAB group, one bar per run; dashed lines are group means."""
    if not entries:
        return None
    plt = _plt()
    tasks = []
    for g in list(GROUP_COLOURS) + ["?"]:
        for e in entries:
            tasks += [n for n, t in e["tasks"].items() if t["group"] == g and n not in tasks]
    width = 0.8 / len(entries)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(tasks) * max(1, len(entries) / 2) + 3), 4.5))
    for i, (colour, e) in enumerate(zip(_colours(len(entries)), entries)):
        xs = [k + (i - (len(entries) - 1) / 2) * width for k, n in enumerate(tasks) if n in e["tasks"]]
        ys = [e["tasks"][n]["test_accuracy"] or 0.0 for n in tasks if n in e["tasks"]]
        ax.bar(xs, ys, width=width, color=colour, label=f"{e['run'].label} (mean {e['mean']:.3f})"
               if e.get("mean") is not None else e["run"].label)
        for g, m in e.get("groups", {}).items():
            idx = [k for k, n in enumerate(tasks) if e["tasks"].get(n, {}).get("group") == g]
            if idx and m is not None:
                ax.hlines(m, min(idx) - 0.45, max(idx) + 0.45, colors=[colour], linestyles="--")
    ax.set_xticks(range(len(tasks)),
                  [f"{n}\n({next(e['tasks'][n]['group'] for e in entries if n in e['tasks'])})" for n in tasks],
                  fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("test top-1 accuracy")
    ax.set_title("VTAB: test accuracy per task (dashed: group means)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)


def dedup_bars(section: dict) -> bytes | None:
    """Images removed per test set by each prepare and dedup run."""
    rows, test_sets = section["rows"], section["test_sets"]
    if not rows or not test_sets:
        return None
    rows = [r for r in rows if r["counts"]]
    if not rows:
        return None
    plt = _plt()
    width = 0.8 / max(1, len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(test_sets) + 0.3 * len(rows) + 3), 4.0))
    for i, (colour, r) in enumerate(zip(_colours(len(rows)), rows)):
        xs = [k + (i - (len(rows) - 1) / 2) * width for k in range(len(test_sets))]
        ys = [r["counts"].get(t, 0) for t in test_sets]
        bars = ax.bar(xs, ys, width=width, color=colour, label=r["run"].label)
        ax.bar_label(bars, fontsize=7)
    ax.set_xticks(range(len(test_sets)), test_sets)
    ax.set_ylabel("corpus images removed")
    ax.set_title("near-duplicates of each test set removed")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)
