"""The upload ledger of every method, measured: what a node sends the server in each exchange.

Each federated method runs two rounds of a tiny synthetic federation at its defaults; the table
lists, per exchange, the entries of the first reply a client sent (``summary.json``'s
``messages``), so the deployment page says what leaves a node from what the code really sent,
not from what a description claims. ``python -m fedlt.docs_ledger [FILE]`` prints (or writes) it.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from fedlt.api import run
from fedlt.calibration.wrapper import reads_knob
from fedlt.methods.registry import METHODS
from fedlt.run_parts import check_config
from fedlt.config import build_config
from fedlt.errors import ConfigError

#: the smallest knobs that keep a method's own steps cheap; the ledger's shapes do not depend on them
#: beyond sample counts (the random features' width, which an upload's shape shows, stays the default)
_CHEAP = {"fedloge": {"sse_steps": 5}, "fedetf": {"adapt_iterations": 1, "adapt_epochs": 1},
          "fedbabu": {"finetune_epochs": 1}, "fedrep": {"head_epochs": 1}}
_CHEAP_CALIBRATION = {"creff_features_per_class": 5, "creff_feature_steps": 2, "creff_retrain_steps": 2,
                      "retrain_steps": 2, "ccvr_virtual_per_class": 5, "safs_steps": 1, "safs_finetune_epochs": 1,
                      "safs_max_per_class": 4, "safs_min_per_class": 2}


def tiny(method: str, out: Path) -> dict[str, Any]:
    spec = METHODS[method]
    tree: dict[str, Any] = {
        "method": method, "method_args": _CHEAP.get(method, {}),
        "loss": {"name": spec.losses[0] if spec.losses else "ce"},
        "data": {"dataset": "synthetic", "num_clients": 4, "imbalance_factor": 10},
        "fl": {"rounds": 2, "participation": 1.0, "local_epochs": 1},
        "eval": {"every": 2}, "run": {"out_dir": str(out), "threads": 1, "checkpoint_every": 0},
    }
    if spec.calibration:
        tree["calibration_args"] = {k: v for k, v in _CHEAP_CALIBRATION.items() if reads_knob(spec.calibration, k)}
    return tree


def node_refusal(method: str) -> str | None:
    """Why a real federation refuses the method at its defaults, None when it runs."""
    tree = tiny(method, Path("/nonexistent"))
    tree.update(engine="flower", flower={"node_data": True})
    try:
        check_config(build_config(tree))
    except ConfigError as err:
        return str(err)
    return None


def uploads(method: str, out: Path) -> dict[str, list[str]]:
    """Exchange -> the entries of a client's reply: model tensors counted, payload by name and shape, the
    sample count every reply carries (the weight of an average), and the metrics by name."""
    summary = run(tiny(method, out), quiet=True).summary
    table: dict[str, list[str]] = {}
    for kind, record in summary["messages"].items():
        reply = record["from_client"]
        entries = [f"model ({reply['model_entries']} tensors)"] if reply["model_entries"] else []
        for key, entry in reply["payload"].items():
            shape = entry.get("shape")
            entries.append(f"`{key}`" + (f" {tuple(shape)}" if shape else ""))
        entries.append("`num_samples`")
        if reply.get("metrics"):
            entries.append("metrics " + ", ".join(f"`{name}`" for name in reply["metrics"]))
        table[kind] = entries
    return table


def method_rows(name: str, out: Path) -> list[str]:
    """The table's rows of one method (its runs write into ``out``)."""
    refusal = node_refusal(name)
    verdict = "runs" if refusal is None else f"refused: {refusal}"
    if METHODS[name].pooled:
        return [f"| `{name}` | - | all training data (pooled) | {verdict} |"]
    return [f"| {f'`{name}`' if i == 0 else ''} | {kind} | {', '.join(entries)} | {verdict if i == 0 else ''} |"
            for i, (kind, entries) in enumerate(uploads(name, out).items())]


def render() -> str:
    lines = ["| method | exchange | what each node sends | under flower.node_data |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in METHODS:
            lines += method_rows(name, Path(tmp))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    page = render()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(page)
    else:
        print(page, end="")
