"""Paper-style tables: one per setting, rows = methods (and variant heads), columns = final-round
GM accuracy overall / many / medium / few and PM accuracy when the runs report it.

Cells are mean ± sample standard deviation (n - 1) over seeds. Per column, the best mean is bold
and the second best underlined; ranks compare the means as printed (2 decimals), so equal printed
values share a mark. Upper bounds (the centralized oracle, real-feature heads) are shown but not
ranked, as in the papers.
"""

from __future__ import annotations

import csv
import io
import statistics
from dataclasses import dataclass

from fedlt.reporting.collect import Collection, Row, Setting

COLUMNS = (("acc", "GM acc"), ("many_acc", "many"), ("medium_acc", "medium"), ("few_acc", "few"), ("pm_acc", "PM acc"))
LATEX_HEADERS = {"acc": "GM", "many_acc": "Many", "medium_acc": "Med.", "few_acc": "Few", "pm_acc": "PM"}
UNRANKED_MARK = "†"


@dataclass
class Stat:
    mean: float
    std: float | None  # None with one seed
    n: int


def stat(values: list[float]) -> Stat | None:
    if not values:
        return None
    return Stat(statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None, len(values))


@dataclass
class Table:
    setting: Setting
    columns: list[tuple[str, str]]
    cells: list[dict[str, Stat | None]]  # per row, per metric
    marks: dict[tuple[int, str], str]  # (row index, metric) -> "best" | "second"

    @property
    def rows(self) -> list[Row]:
        return self.setting.rows


def build_table(setting: Setting) -> Table:
    metrics = [m for m, _ in COLUMNS]
    cells = [{m: stat(row.values(m)) for m in metrics} for row in setting.rows]
    columns = [(m, h) for m, h in COLUMNS if m != "pm_acc" or any(c["pm_acc"] for c in cells)]
    marks: dict[tuple[int, str], str] = {}
    for metric, _ in columns:
        shown = {i: round(c[metric].mean, 2) for i, c in enumerate(cells)
                 if c[metric] is not None and setting.rows[i].ranked}
        levels = sorted(set(shown.values()), reverse=True)
        for i, v in shown.items():
            if v == levels[0]:
                marks[(i, metric)] = "best"
            elif len(levels) > 1 and v == levels[1]:
                marks[(i, metric)] = "second"
    return Table(setting, columns, cells, marks)


def _number(s: Stat | None, pm: str) -> str:
    if s is None:
        return "-"
    return f"{s.mean:.2f}" if s.std is None else f"{s.mean:.2f} {pm} {s.std:.2f}"


def _label(row: Row) -> str:
    label = row.label + (f" {UNRANKED_MARK}" if not row.ranked else "")
    if row.expected and len(row.runs) < row.expected:
        label += f" ({len(row.runs)}/{row.expected} seeds)"
    return label


def _caption_text(c: Collection) -> str:
    seeds = ", ".join(map(str, c.seeds))
    spread = f"mean ± sample std over seeds {seeds}" if len(c.seeds) > 1 else f"one seed ({seeds}), so no std"
    return (f"Final-round accuracy (%): the global model (GM) on the balanced test set, overall and per shot "
            f"group, and personalized accuracy (PM: mean over clients of accuracy on local test sets drawn in each "
            f"client's training proportions) where reported; {spread}. Per column the "
            f"best is **bold** and the second <u>underlined</u>; rows marked {UNRANKED_MARK} are upper bounds "
            "(centralized training, heads re-trained on real features: not private) and are not ranked.")


def _setting_facts(setting: Setting) -> str:
    run = setting.first_run()
    if run is None:
        return "No finished run yet."
    s = run.summary
    return (f"{s.get('dataset', '?')}-LT, {s.get('rounds', '?')} rounds; {s.get('data', '')}; shot groups — "
            f"{s.get('shot_rule', '?')}.")


def markdown(c: Collection, tables: list[Table]) -> str:
    lines = [f"# {c.title}", ""]
    if c.description:
        lines += [c.description, ""]
    lines += [_caption_text(c)]
    for t in tables:
        lines += ["", f"## {t.setting.name}", "", _setting_facts(t.setting), "",
                  "| method | " + " | ".join(h for _, h in t.columns) + " |", "|---|" + "---|" * len(t.columns)]
        for i, row in enumerate(t.rows):
            cells = []
            for metric, _ in t.columns:
                text = _number(t.cells[i][metric], "±")
                mark = t.marks.get((i, metric))
                cells.append(f"**{text}**" if mark == "best" else f"<u>{text}</u>" if mark == "second" else text)
            lines.append(f"| {_label(row).replace('|', '/')} | " + " | ".join(cells) + " |")
        if t.setting.warnings:
            lines += ["", *(f"> note: {w}" for w in t.setting.warnings)]
    if c.report_messages:
        lines += ["", *messages_section(tables)]
    if c.notes:
        lines += ["", c.notes]
    return "\n".join(lines) + "\n"


def messages_section(tables: list[Table]) -> list[str]:
    """What one client uploads per kind of exchange, from the first finished run's record."""
    run = next((t.setting.first_run() for t in tables if t.setting.first_run() is not None), None)
    if run is None:
        return []
    lines = ["## What a client uploads (bytes per message)", ""]
    for kind, both in (run.summary.get("messages") or {}).items():
        up = both["from_client"]
        entries = ", ".join(f"`{k}` {e.get('shape', e.get('value'))} {e['bytes']}" for k, e in up["payload"].items())
        lines.append(f"- {kind}: model {up['model_bytes']} bytes; {entries or 'no payload'}")
    lines.append(f"\n(first client of {run.path})")
    return lines


def csv_text(tables: list[Table]) -> str:
    """One line per (setting, row): means, stds and the number of seeds, unformatted."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    metrics = [m for m, _ in COLUMNS]
    writer.writerow(["setting", "row", "variant", "ranked", "seeds", *(f"{m}_{k}" for m in metrics for k in ("mean", "std"))])
    for t in tables:
        for i, row in enumerate(t.rows):
            values = []
            for m in metrics:
                s = t.cells[i][m]
                values += ["" if s is None else f"{s.mean:.4f}", "" if s is None or s.std is None else f"{s.std:.4f}"]
            writer.writerow([t.setting.name, row.label, row.variant or "", int(row.ranked), len(row.runs), *values])
    return buf.getvalue()


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "†": r"$^\dagger$"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def latex(c: Collection, tables: list[Table]) -> str:
    lines = [f"% {c.title}: generated by `fedlt report`; needs \\usepackage{{booktabs}}",
             f"% seeds {', '.join(map(str, c.seeds))}; best \\textbf{{bold}}, second \\underline{{underlined}}"]
    for t in tables:
        lines += ["", r"\begin{table}[t]", r"\centering",
                  f"\\caption{{{latex_escape(c.title)}: {latex_escape(t.setting.name)}. Final-round accuracy (\\%), "
                  + (f"mean $\\pm$ std over {len(c.seeds)} seeds" if len(c.seeds) > 1 else "one seed")
                  + "; best in bold, second underlined"
                  + (f"; $^\\dagger$ upper bound, not ranked" if any(not r.ranked for r in t.rows) else "") + ".}",
                  r"\begin{tabular}{l" + "c" * len(t.columns) + "}", r"\toprule",
                  "Method & " + " & ".join(LATEX_HEADERS[m] for m, _ in t.columns) + r" \\", r"\midrule"]
        for i, row in enumerate(t.rows):
            cells = []
            for metric, _ in t.columns:
                text = _number(t.cells[i][metric], r"$\pm$")
                mark = t.marks.get((i, metric))
                cells.append(f"\\textbf{{{text}}}" if mark == "best" else f"\\underline{{{text}}}" if mark == "second"
                             else text)
            lines.append(latex_escape(_label(row)) + " & " + " & ".join(cells) + r" \\")
        lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"
