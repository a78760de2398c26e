"""The report's account of choices made on validation data: every candidate of a grid row, its
validation score per setting, and the one selected, so a reader sees what was chosen and on what
before reading the chosen candidate's test accuracy in the table."""

from __future__ import annotations

import statistics

from fedlt.bench.selection import Selection


def _score(values: dict[int, float]) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values.values())
    spread = f" ± {statistics.stdev(values.values()):.2f}" if len(values) > 1 else ""
    return f"{mean:.2f}{spread} ({len(values)})"


def selection_section(selections: list[Selection]) -> list[str]:
    """Markdown lines: one table per grid row (candidates x settings), the chosen candidate in bold."""
    if not selections:
        return []
    lines = ["## Choices made on validation data", "",
             "Each row below ran every candidate of its grid (a candidate named with a variant, and a row's "
             "personalized-model choice, is another reading of the same runs, which trains nothing); the table above "
             "shows the selected one's test accuracy only. Scores: final-round validation metric, mean ± std over "
             "seeds (count)."]
    for sel in selections:
        settings = sel.settings
        across = not sel.per_setting
        how = ("one choice for every setting: the highest mean over settings of each setting's mean"
               if across else "per setting: the highest mean over seeds")
        lines += ["", f"**{sel.row}**, selected on `{sel.metric}` ({how}):", "",
                  "| candidate | " + " | ".join(settings) + (" | mean over settings |" if across else " |"),
                  "|---|" + "---|" * (len(settings) + across)]
        for candidate in sel.scores:
            cells = []
            for s in settings:
                text = _score(sel.scores[candidate].get(s, {}))
                cells.append(f"**{text}**" if sel.chosen.get(s) == candidate else text)
            if across:
                overall = sel.overall(candidate, settings)
                text = "-" if overall is None else f"{overall:.2f}"
                cells.append(f"**{text}**" if candidate in sel.chosen.values() else text)
            lines.append(f"| `{candidate}` | " + " | ".join(cells) + " |")
        for candidate, cells in sel.diverged.items():
            lines += ["", f"> `{candidate}` diverged (NaN training loss) in {len(cells)} cell(s): {'; '.join(cells)}"
                      + ("; passed over: a default must not diverge" if len(sel.diverged) < len(sel.scores) else "")]
        if not sel.complete:
            lines += ["", "> note: some candidates lack seeds in some settings; the choice may change when they finish."]
    return lines
