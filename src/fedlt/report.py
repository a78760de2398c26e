"""Tables that compare finished runs."""

from __future__ import annotations

from typing import Any


def _cell(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def comparison_table(summaries: list[tuple[str, dict[str, Any]]]) -> str:
    """Markdown: one row per run with final-round GM (overall, many/medium/few) and PM accuracy.

    The headline is the final round; the best round's GM accuracy is a separate, labelled column.
    """
    rules = sorted({s.get("shot_rule", "") for _, s in summaries})
    lines = [
        "| run | method | loss | final round | GM acc | many | medium | few | PM acc | best-round GM acc (round) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries:
        f, b = s["final"], s["best_round"]
        loss = s.get("loss", "-")
        lines.append(
            f"| {name} | {s['method']} | {loss} | {f['round']} | {_cell(f['acc'])} | {_cell(f['many_acc'])} "
            f"| {_cell(f['medium_acc'])} | {_cell(f['few_acc'])} | {_cell(f['pm_acc'])} "
            f"| {_cell(b['acc'])} ({b['round']}) |"
        )
    lines += ["", "Shot groups: " + "; ".join(rules)]
    return "\n".join(lines)
