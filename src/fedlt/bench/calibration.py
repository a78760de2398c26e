"""``fedlt bench calibration``: FedAvg vs. the classifier calibrations on one backbone.

One run per (alpha, seed) trains FedAvg with CReFF's per-round exchange and, after the last
round, builds every post-hoc head (CCVR, FedNCM, Fed3R, tau-norm, the real-feature oracle) from
one statistics query. CReFF never changes what is broadcast, so the uncalibrated model of that
run *is* FedAvg's and every row of the table shares one backbone — a controlled comparison.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from fedlt.api import run

ROWS = [("FedAvg", "uncalibrated"), ("CReFF", "creff"), ("CCVR", "ccvr"), ("FedNCM", "fedncm"),
        ("Fed3R", "fed3r"), ("tau-norm", "taunorm"), ("real-feature oracle (not private)", "oracle")]
METRICS = (("acc", "overall"), ("many_acc", "many"), ("medium_acc", "medium"), ("few_acc", "few"))


def _final_heads(summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    final = summary["final"]
    heads = dict(final.get("variants") or {})
    heads["creff"] = {k: final[k] for k, _ in METRICS}
    return heads


def _cell(values: list[float | None]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def run_calibration_bench(config: str | None, overrides: list[str], alphas: list[float], seeds: list[int],
                          out_dir: str, quiet: bool = False) -> str:
    results: dict[float, list[dict[str, Any]]] = {}
    rule, messages = "", {}
    for alpha in alphas:
        for seed in seeds:
            res = run(config, overrides=[
                *overrides, "method=creff", "calibration=[ccvr,fedncm,fed3r,taunorm,oracle]",
                f"data.alpha={alpha}", f"seed={seed}", f"run.out_dir={out_dir}", f"run.name=alpha{alpha}-seed{seed}",
            ], quiet=quiet)
            results.setdefault(alpha, []).append(res.summary)
            rule, messages = res.summary["shot_rule"], res.summary["messages"]
    first = next(iter(results.values()))[0]
    lines = [
        f"# Classifier calibration on {first['dataset']}-LT",
        "",
        f"Final-round accuracy (%) on the balanced test set, mean ± std over seeds {seeds}; "
        f"{first['rounds']} rounds; shot groups: {rule}.",
        "All rows of one (alpha, seed) share the FedAvg backbone of one run (see the module docstring).",
    ]
    for alpha, summaries in results.items():
        heads = [_final_heads(s) for s in summaries]
        lines += ["", f"## Dirichlet alpha = {alpha}", "",
                  "| method | " + " | ".join(label for _, label in METRICS) + " |",
                  "|---|" + "---|" * len(METRICS)]
        for label, key in ROWS:
            cells = [_cell([h[key][m] for h in heads if key in h]) for m, _ in METRICS]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "## What a client uploads (bytes per message)", ""]
    for kind, both in messages.items():
        up = both["from_client"]
        entries = ", ".join(f"`{k}` {e.get('shape')} {e['bytes']}" for k, e in up["payload"].items())
        lines.append(f"- {kind}: model {up['model_bytes']} bytes; {entries or 'no payload'}")
    lines += ["", "In `query:calibration_stats` the `class_sums/*` entries serve CCVR, `normalized_sums/*` FedNCM, "
              "`ridge_sums/*` Fed3R and `features/*` only the oracle; tau-norm needs no upload. CReFF's `creff/*` "
              "entries ride on every fit reply, one C x (d+1) gradient per class the client holds (the line above "
              "is one client of the last run; clients hold 1 to 10 classes)."]
    return "\n".join(lines)


def write(text: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
