"""The report's figures, as small PNGs (dpi 100): accuracy vs round, shot-group bars, the
client x class partition heatmap, per-class accuracy against class size, a method's own
per-round diagnostics, and real vs synthetic features in one PCA plane. Every figure has a
title, axis labels with units and a legend.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedlt.reporting.collect import Row, Run, Setting
from fedlt.reporting.stats import summarize
from fedlt.results import ROWS_EACH, SIZE_BINS, removed_unless_renamed

DPI = 100
SHOTS = (("acc", "overall"), ("many_acc", "many"), ("medium_acc", "medium"), ("few_acc", "few"))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    plt = _plt()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("tmp-" + path.name)
    try:  # closed however it ends: a long-lived process (a bench's report) would keep every failed figure
        with removed_unless_renamed(tmp):
            fig.savefig(tmp, dpi=DPI, bbox_inches="tight")
            os.replace(tmp, path)
    finally:
        plt.close(fig)
    return path


def _colors(n: int) -> list:
    plt = _plt()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def _mean_curve(row: Row, key: str, lines: Callable[[Run], list[dict[str, Any]]] = Run.curve
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Rounds with ``key`` in every seed's ``lines`` (default: the evaluated rounds), with the mean
    and std of ``key`` there."""
    per_seed = [{r["round"]: r[key] for r in lines(run) if r.get(key) is not None} for run in row.runs]
    per_seed = [c for c in per_seed if c]
    if not per_seed:
        return None
    rounds = sorted(set.intersection(*(set(c) for c in per_seed)))
    if not rounds:
        return None
    values = np.array([[c[r] for r in rounds] for c in per_seed])
    return np.array(rounds), values.mean(0), values.std(0, ddof=1) if len(per_seed) > 1 else np.zeros(len(rounds))


def _same_curves(rows: list[Row], keys: tuple[str, ...]) -> list[tuple[str, Row]]:
    """Rows whose curves are identical in every key (e.g. FedRoD's generic model is FedAvg (BSM)'s),
    drawn once under their joined labels so that no line hides another."""
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        signature = tuple((key, tuple(np.round(c[1], 6)) if (c := _mean_curve(row, key)) is not None else None)
                          for key in keys)
        groups.setdefault(signature, []).append(row)
    return [(" = ".join(r.label for r in same), same[0]) for same in groups.values()]


def plot_curves(setting: Setting, path: Path) -> Path | None:
    """GM accuracy and few-shot accuracy vs round, per method row: mean over seeds, ± std band."""
    rows = [r for r in setting.rows if r.variant is None and r.runs]
    if not rows:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=False)
    drawn = _same_curves(rows, ("acc", "few_acc"))
    for color, (label, row) in zip(_colors(len(drawn)), drawn):
        for ax, key in zip(axes, ("acc", "few_acc")):
            curve = _mean_curve(row, key)
            if curve is None:
                continue
            x, mean, std = curve
            ax.plot(x, mean, marker="o", ms=3, color=color, label=label)
            ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.15, linewidth=0)
    seeds = max(len(r.runs) for r in rows)
    epochs = any(r.runs[0].summary.get("method") == "centralized" for r in rows)
    for ax, what in zip(axes, ("overall", "few-shot classes")):
        ax.set(xlabel="communication round" + (" (centralized: epoch)" if epochs else ""), ylabel="test accuracy (%)", title=f"GM accuracy, {what}")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))  # rounds are whole numbers
        ax.grid(alpha=0.3)
    _legend(axes[1], loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8, title="method")
    band = f"mean ± std over {seeds} seeds" if seeds > 1 else "1 seed"
    fig.suptitle(f"{setting.name}: accuracy vs round ({band}; post-hoc heads appear at the last round only)",
                 fontsize=10)
    return _save(fig, path)


def diagnostic_keys(setting: Setting) -> list[str]:
    """The method diagnostics worth a curve: numbers some run logs with changing values over rounds
    (constants such as a privacy budget are already in the run's summary)."""
    keys: set[str] = set()
    for run in (run for row in setting.rows if row.variant is None for run in row.runs):
        values: dict[str, set[float]] = {}
        for line in run.diagnostics():
            for k, v in line.items():
                values.setdefault(k, set()).add(float(v))
        keys |= {k for k, v in values.items() if k != "round" and len(v) > 1}
    return sorted(keys)


def plot_diagnostics(setting: Setting, path: Path, max_keys: int = 4) -> Path | None:
    """Each changing method diagnostic (:func:`diagnostic_keys`, the first ``max_keys``) vs round,
    per row that logs it: mean over seeds, ± std band. None when no run logs one."""
    keys = diagnostic_keys(setting)[:max_keys]
    if not keys:
        return None
    rows = [r for r in setting.rows if r.variant is None and r.runs]
    plt = _plt()
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.2), squeeze=False)
    for color, row in zip(_colors(len(rows)), rows):
        for ax, key in zip(axes[0], keys):
            curve = _mean_curve(row, key, Run.diagnostics)
            if curve is None:
                continue
            x, mean, std = curve
            ax.plot(x, mean, marker="o", ms=3, color=color, label=row.label)
            ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.15, linewidth=0)
    for ax, key in zip(axes[0], keys):
        ax.set(xlabel="communication round", ylabel=key, title=key)
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    _legend(axes[0][-1], loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8, title="method")
    seeds = max(len(r.runs) for r in rows)
    band = f"mean ± std over {seeds} seeds" if seeds > 1 else "1 seed"
    fig.suptitle(f"{setting.name}: the methods' own diagnostics vs round ({band})", fontsize=10)
    return _save(fig, path)


def shot_bars(row: Row) -> tuple[list[float], list[float]]:
    """Per shot group (overall, many, medium, few): the mean over seeds and the half-width of its
    95% t-interval (0 for one seed; NaN mean where no seed reports the group)."""
    means, halves = [], []
    for key, _ in SHOTS:
        stats = summarize(row.values(key)) if row.values(key) else None
        means.append(stats.mean if stats else np.nan)
        halves.append(stats.ci[1] - stats.mean if stats and stats.ci else 0.0)
    return means, halves


def plot_shot_bars(setting: Setting, path: Path) -> Path | None:
    """Overall / many / medium / few GM accuracy per row (variants included), error bars = the 95%
    t-interval of the mean over seeds."""
    rows = [r for r in setting.rows if r.values("acc")]
    if not rows:
        return None
    plt = _plt()
    n = len(rows)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 + 0.35 * n * len(SHOTS) * 0.8), 4.2))
    x = np.arange(len(SHOTS))
    for i, (color, row) in enumerate(zip(_colors(n), rows)):
        means, halves = shot_bars(row)
        many_seeds = len(row.runs) > 1
        ax.bar(x - 0.4 + width * (i + 0.5), means, width, yerr=halves if many_seeds else None, color=color,
               label=row.label, capsize=2, error_kw={"elinewidth": 0.8})
    groups = rows[0].runs[0].summary.get("shot_groups") or {}
    ax.set_xticks(x, ["all classes" if key == "acc" else f"{name}-shot\n({len(groups.get(name, []))} classes)"
                      for key, name in SHOTS])
    seeds = max(len(r.runs) for r in rows)
    ax.set(ylabel="final-round test accuracy (%)", ylim=(0, 100),
           title=f"{setting.name}: GM accuracy by shot group "
                 + (f"(mean over {seeds} seeds; error bars: 95% interval of the mean)" if seeds > 1 else "(1 seed)"))
    ax.grid(axis="y", alpha=0.3)
    _legend(ax, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, title="method / head")
    return _save(fig, path)


def plot_partition(record: dict[str, Any], path: Path) -> Path:
    """The client x class heatmap of sample counts (as in SFD's Fig. 1), log colour scale."""
    plt = _plt()
    from matplotlib.colors import LogNorm

    counts = np.asarray(record["counts"], dtype=float)
    k, c = counts.shape
    order = np.argsort(-counts.sum(0), kind="stable")  # head -> tail, also when the classes were shuffled
    counts = counts[:, order]
    fig, (ax, side) = plt.subplots(1, 2, figsize=(min(4 + 0.45 * c, 16), min(2 + 0.28 * k, 14)),
                                   gridspec_kw={"width_ratios": [max(c, 4), max(2.2, 0.22 * c)], "wspace": 0.05},
                                   sharey=True)  # the side bar keeps its share of the width at 1,000 classes
    masked = np.ma.masked_where(counts == 0, counts)
    im = ax.imshow(masked, aspect="auto", cmap="viridis", norm=LogNorm(vmin=1, vmax=max(counts.max(), 2)),
                   interpolation="nearest")
    if k * c <= 400:
        for (i, j), v in np.ndenumerate(counts):
            if v:
                ax.text(j, i, f"{int(v)}", ha="center", va="center", fontsize=6,
                        color="white" if v < np.sqrt(max(counts.max(), 1)) else "black")
    totals = counts.sum(0).astype(int)
    if c <= 20:
        ax.set_xticks(range(c), [f"{order[j]}\n({totals[j]})" for j in range(c)], fontsize=7)
    ax.set_yticks(range(k)) if k <= 40 else None
    ax.set(xlabel="class index (training samples), head → tail" if c <= 20 else  # more: ticks count classes
           "classes by training samples, head → tail", ylabel="client")
    sizes = counts.sum(1)
    side.barh(range(k), sizes, color="grey")
    side.set(xlabel="samples")
    side.tick_params(axis="y", left=False)
    fig.colorbar(im, ax=[ax, side], label="training samples (log scale; blank = none)", pad=0.02)
    from fedlt.data.registry import lt_name, tail_label

    d = record
    part = f"Dirichlet alpha={d['alpha']:g}" if d.get("alpha") is not None else d.get("partition", "")
    ax.set_title(f"Partition: {lt_name(d['dataset'])}, {tail_label(d['dataset'], d['imbalance_factor'])}, "
                 f"{part}, {k} clients (seed {d.get('seed', '?')})", fontsize=10, loc="left")
    return _save(fig, path)


def by_class_size(runs: list[Run]) -> tuple[np.ndarray, np.ndarray]:
    """Per-class final accuracy averaged over seeds by class *size rank* (smallest first), with the
    mean class size of each rank: under ``data.class_order=shuffled`` a class index is the head in
    one seed and the tail in another, so averaging by index would mix head and tail."""
    sizes, accs = [], []
    for run in runs:
        acc, counts = run.summary["final"].get("per_class_acc"), run.summary.get("train_class_counts")
        if acc and counts:  # a run aborted before its counts were known has none
            counts = np.asarray(counts, dtype=float)
            rank = np.argsort(counts, kind="stable")
            sizes.append(counts[rank])
            accs.append(np.asarray(acc, dtype=float)[rank])
    return np.mean(sizes, axis=0), np.mean(accs, axis=0)


def plot_per_class(setting: Setting, path: Path) -> Path | None:
    """Final per-class accuracy against the class's training samples (log x), per method row."""
    rows = [r for r in setting.rows if r.variant is None and r.runs
            and r.runs[0].summary.get("final", {}).get("per_class_acc") and r.runs[0].summary.get("train_class_counts")]
    if not rows:
        return None
    plt = _plt()
    run0 = rows[0].runs[0].summary
    counts = np.asarray(run0["train_class_counts"], dtype=float)
    seeds = max(len(r.runs) for r in rows)
    fig, ax = plt.subplots(figsize=(8.5, 4.4))
    drawn: dict[tuple, tuple[list[str], np.ndarray, np.ndarray]] = {}  # identical curves drawn once
    binned = len(counts) > ROWS_EACH  # a point per class would be a comb of 0s and 100s
    for row in rows:
        sizes, mean = by_class_size(row.runs)
        if binned:
            sizes, mean = (np.array([part.mean() for part in np.array_split(v, SIZE_BINS)]) for v in (sizes, mean))
        drawn.setdefault(tuple(np.round(mean, 6)), ([], sizes, mean))[0].append(row.label)
    for color, (labels, sizes, mean) in zip(_colors(len(drawn)), drawn.values()):
        ax.plot(sizes, mean, marker="o", ms=4, lw=1, color=color, label=" = ".join(labels))
    groups = run0.get("shot_groups") or {}
    for low_name, high_name in (("few", "medium"), ("medium", "many")):
        low, high = groups.get(low_name) or [], groups.get(high_name) or []
        if low and high:
            edge = np.sqrt(counts[low].max() * counts[high].min())
            ax.axvline(edge, color="grey", ls="--", lw=0.8)
            ax.text(edge, 101, f"{low_name} | {high_name}", ha="center", va="bottom", fontsize=7, color="grey")
    ax.set_xscale("log")
    from matplotlib.ticker import LogLocator, ScalarFormatter

    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    per = f"{len(counts)} classes in {SIZE_BINS} bins by size, each point a bin's mean; " if binned else ""
    ax.set(xlabel="training samples of the class in the federation (log scale)", ylabel="final test accuracy (%)",
           ylim=(-2, 108), title=f"{setting.name}: per-class accuracy vs class size ({per}"
                 + (f"mean over {seeds} seeds by size rank)" if seeds > 1 else "1 seed)"))
    ax.grid(alpha=0.3, which="both")
    _legend(ax, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, title="method")
    return _save(fig, path)


def _legend(ax, **options) -> None:
    """The legend of ``ax``, where it has a labelled line (runs whose metrics hold no rows draw none)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**options)


def synthetic_sets(artifacts: dict[str, Any]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{name: (features, labels)}`` for every ``[name/]synthetic_features`` + ``..._labels`` pair."""
    out = {}
    for key, value in artifacts.items():
        if key.endswith("synthetic_features"):
            prefix = key[: -len("synthetic_features")]
            labels = artifacts.get(prefix + "synthetic_labels")
            if labels is not None:
                out[prefix.rstrip("/") or "synthetic"] = (np.asarray(value, dtype=float), np.asarray(labels))
    return out


def plot_features(artifacts: dict[str, Any], path: Path, title: str, class_names: list[str] | None = None
                  ) -> Path | None:
    """Real test-set features and each synthetic set, projected on the real features' first two
    principal components (one basis for all panels, so positions are comparable)."""
    sets = synthetic_sets(artifacts)
    if not sets or "test_features" not in artifacts:
        return None
    plt = _plt()
    real = np.asarray(artifacts["test_features"], dtype=float)
    real_y = np.asarray(artifacts["test_labels"])
    center = real.mean(0)
    _, _, vt = np.linalg.svd(real - center, full_matrices=False)
    basis = vt[:2].T
    panels = [("real test-set features", (real - center) @ basis, real_y)]
    panels += [(f"synthetic: {name}", (f - center) @ basis, y) for name, (f, y) in sets.items()]
    num_classes = int(max(real_y.max(), *(y.max() for _, _, y in panels))) + 1
    colors = _colors(num_classes)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), sharex=True, sharey=True, squeeze=False)
    everything = np.concatenate([p for _, p, _ in panels])
    lo, hi = np.percentile(everything, 1, axis=0), np.percentile(everything, 99, axis=0)
    pad = 0.08 * (hi - lo)
    for ax, (name, points, labels) in zip(axes[0], panels):
        for cls in range(num_classes):
            sel = labels == cls
            if sel.any():
                legend = f"{cls} {class_names[cls]}" if class_names and cls < len(class_names) else str(cls)
                ax.scatter(points[sel, 0], points[sel, 1], s=5, alpha=0.6, color=colors[cls], label=legend)
        ax.set(title=f"{name} (n={len(points)})", xlabel="PC 1 of real features")
        ax.set_xlim(lo[0] - pad[0], hi[0] + pad[0])
        ax.set_ylim(lo[1] - pad[1], hi[1] + pad[1])
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("PC 2 of real features")
    if num_classes <= 20:
        _legend(axes[0][-1], loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, title="class", markerscale=2)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)
