"""``fedlt table``: one Markdown table that compares finished runs by their ``summary.json``."""

from __future__ import annotations

from typing import Any

from fedlt.results import (check_summary, nonfinite_personal, nonfinite_variants, percent_cell, percent_cells,
                           personal_nan_label, unevaluated_note)

#: the accuracy and its shot groups, the columns every row has
SHOTS = ("acc", "many_acc", "medium_acc", "few_acc")


def comparison_table(summaries: list[tuple[str, dict[str, Any]]]) -> str:
    """Markdown: one row per run with final-round GM (overall, many/medium/few) and PM accuracy,
    plus one row per evaluated variant of its global model (other calibrations, uncalibrated).

    The headline is the final round; the best round's GM accuracy is a separate, labelled column.
    """
    summaries = [(name, check_summary(s, name)) for name, s in summaries]
    rules = sorted({s.get("shot_rule", "") for _, s in summaries})
    lines = [
        "| run | method | loss | final round | GM acc | many | medium | few | PM acc | best round's GM acc "
        "(round, chosen by) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries:
        f, b = s["final"], s["best_round"]
        loss = s.get("loss", "-")
        calibration = s.get("calibration") or []
        label = f"{name} [{calibration[0]}]" if calibration else name
        if s.get("status"):  # a run that did not finish (diverged, aborted): its numbers are not a result
            done = s.get("rounds_done")
            label += (f" ({s['status']}" + ("" if done is None else f" in round {done + 1}" if s["status"] == "diverged"
                                            else f" after round {done}") + ")")
        label += unevaluated_note(s)
        pm_nan = nonfinite_personal(f).get(None)
        label += f" ({personal_nan_label(pm_nan)})" if pm_nan else ""
        lines.append(
            f"| {label} | {s['method']} | {loss} | {f['round']} | {percent_cells(f, SHOTS + ('pm_acc',))} "
            f"| {percent_cell(b.get('acc'))} ({b.get('round', '-')}, {b.get('selected_by') or '-'}) |"
        )
        for variant, v in (f.get("variants") or {}).items():
            tag = f"{variant}, not private" if variant == "oracle" else variant
            tag += ", non-finite model" if variant in nonfinite_variants(f) else ""
            lines.append(
                f"| {name} [{tag}] | {s['method']} | {loss} | {f['round']} | {percent_cells(v, SHOTS)} | - | - |"
            )
    lines += ["", "Shot groups: " + "; ".join(rules),
              "Rows `[name]` are heads evaluated on the same run's backbone; `[uncalibrated]` is the method "
              "without calibration. PM accuracy is reported for the headline model only. The best round is the "
              "one with the highest figure named (val_acc with a validation split): one chosen by acc, the test "
              "accuracy itself, is an optimistic figure, not a result. Every run given is listed, a bench's grid "
              "candidates too; `fedlt report` shows only the candidate chosen on validation data."]
    return "\n".join(lines)
