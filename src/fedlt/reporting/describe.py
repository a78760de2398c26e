"""``fedlt data describe``: the federation a config builds, printed and drawn, without training."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from fedlt.config import DIRICHLET_PARTITIONS, DataConfig, federation_seed, load_config, partition_label
from fedlt.data.federated import build_federated_data
from fedlt.data.registry import DATASETS, lt_name, tail_label
from fedlt.evaluation import shot_groups
from fedlt.reporting.plots import plot_partition
from fedlt.results import ROWS_EACH, listed, partition_record, size_bins, write_atomic


#: the data keys beyond the header's that change which samples the clients hold
DRAW_KEYS = ("class_order", "train_fraction", "min_client_size", "max_retries", "equal_size", "val_per_class",
             "val_from")


def other_draw_settings(d: DataConfig) -> dict[str, Any]:
    """The :data:`DRAW_KEYS` that ``d`` sets away from their defaults."""
    return {k: getattr(d, k) for k in DRAW_KEYS if getattr(d, k) != DataConfig.model_fields[k].default}


def describe_data(config: str | None, overrides: list[str], out: Path) -> tuple[str, list[Path]]:
    """Text describing the long tail, shot groups and every client; writes the heatmap PNG and
    ``partition.json`` (same format as a run directory's) into ``out``."""
    cfg = load_config(config, overrides)
    data = build_federated_data(cfg.data, cfg.seed, "cpu")
    counts = data.partition.counts
    totals = data.train_counts
    groups = shot_groups(totals, cfg.eval, counts, len(data.test))
    names = data.train.classes
    d = cfg.data
    part = partition_label(d.partition, d.alpha, d.classes_per_client) \
        + (f", {d.rounding.replace('_', '-')} rounding" if d.rounding != "floor" else "")
    as_distributed = DATASETS[d.dataset].long_tailed  # data.imbalance_factor does not apply
    tail = tail_label(d.dataset, d.imbalance_factor)
    seed = federation_seed(d, cfg.seed)  # what the federation is drawn from: data.seed where it is set
    others = other_draw_settings(d)
    also = "; " + ", ".join(f"data.{k}={json.dumps(v)}" for k, v in others.items()) if others else ""
    lines = [f"{lt_name(d.dataset)}: {tail}, {part}, {d.num_clients} clients, seed {seed}{also}",
             data.describe(), "", f"Shot groups ({groups.rule}):"]
    for g, classes in groups.classes.items():
        lines.append(f"  {g:6s} {len(classes):3d} classes: " + (listed([f"{c} ({totals[c]})" for c in classes]) or "none"))
    holders = (counts > 0).sum(0)
    if len(totals) <= ROWS_EACH:
        lines += ["", "class  name                 samples  clients holding it"]
        lines += [f"{c:5d}  {str(names[c])[:20]:20s} {totals[c]:7d}  {int(holders[c]):3d}" for c in range(len(totals))]
    else:
        lines += ["", f"{len(totals)} classes from head to tail in bins of about equal numbers of classes (every "
                  "class's counts per client are in the partition JSON):",
                  "bin  classes  samples each  clients holding one (mean)"]
        for k, (members, span) in enumerate(size_bins([int(t) for t in totals]), start=1):
            lines.append(f"{k:3d}  {len(members):7d}  {span:>12s}  {holders[members].mean():.1f}")
    rows = []
    for k, row in enumerate(counts):
        n = int(row.sum())
        top = int(row.argmax())
        share = f"{top} ({100 * row[top] / n:.0f}%)" if n else "-"
        rows.append(f"{k:6d}  {n:7d}  {int((row > 0).sum()):7d}  {share}")
    lines += ["", "client  samples  classes  largest class (share)"]
    if len(rows) <= ROWS_EACH:
        lines += rows
    else:  # the five largest and the five smallest
        order = np.argsort(-counts.sum(1), kind="stable")
        lines += [*(rows[k] for k in order[:5]), f"   ... {len(rows) - 10} more clients (every client is in the "
                  "partition JSON)", *(rows[k] for k in order[-5:])]
    record = partition_record(cfg, counts, names)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{d.dataset}-{'lt' if as_distributed else f'if{d.imbalance_factor:g}'}-{d.partition}" \
        + (f"-a{d.alpha:g}" if d.partition in DIRICHLET_PARTITIONS else "") \
        + (f"-c{d.classes_per_client}" if d.partition == "pathological" else "") \
        + ("-largest-remainder" if d.rounding != "floor" else "") + f"-k{d.num_clients}-seed{seed}" \
        + (f"-{hashlib.blake2b(json.dumps(others, sort_keys=True).encode(), digest_size=4).hexdigest()}"
           if others else "")  # another federation's files are not overwritten
    json_path = out / f"partition-{stem}.json"
    write_atomic(json_path, json.dumps(record) + "\n")
    png = plot_partition(record, out / f"partition-{stem}.png")
    return "\n".join(lines), [png, json_path]
