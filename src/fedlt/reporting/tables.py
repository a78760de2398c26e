"""Paper-style tables: one per setting, rows = methods (and variant heads), columns = final-round
GM accuracy overall / many / medium / few and PM accuracy when the runs report it.

Cells are mean ± sample std (n - 1) over seeds. The headline GM accuracy also gets its 95%
t-interval, and GM and PM accuracy their paired difference Δ to the setting's reference row,
taken seed by seed (:mod:`fedlt.reporting.stats`), with the half-width of its 95% interval and the
interval, e.g. ``+6.89 ±6.65 [0.23, 13.54] *``: ``*`` when the interval excludes 0 (resolved),
``n.r.`` when it does not (not resolved: the seeds cannot tell the sign, which is no evidence that
the rows are equal). Under each table, the smallest half-width its paired differences achieved
(what this table can resolve, not a noise floor measured elsewhere), the machine and the code the
runs ran (:mod:`fedlt.reporting.provenance`; a row whose seeds ran different code is marked ‡).

Bold and underline claim an order, so they are given only where the seeds resolve it. Per
column, the ranked rows are sorted by mean; the top one is best only if its paired lead over every
other ranked row is resolved (paired differences are not transitive: a resolved lead over the second
says nothing of a third whose seeds vary more); the second is second only if its lead over every row
below it is resolved too; and a row whose difference to the reference is not resolved is never marked
(the reference itself can be). A row of fewer than 2 seeds in a column is neither marked there nor
counted against the others; one seed, or a single ranked row, marks nothing. Validation columns
are not marked: choices are made on them, results are not read there. Upper bounds (the
centralized oracle, real-feature heads, a suite's ``unranked``) are shown but not ranked.

The CSV has one line per (setting, row) with what was chosen for it on validation data (``chosen``: the
grid candidate whose cells it reads, ``PM: NAME`` its personal reading; empty without either), the code
versions its runs ran (``code``, separated by ``; ``) and, per metric ``m``: ``m_mean, m_std, m_ci_lo, m_ci_hi, m_diff, m_diff_half, m_diff_ci_lo,
m_diff_ci_hi, m_diff_p, m_resolved`` (the difference to the reference row, empty on that row), then
one column ``m_seed<S>`` per seed found in any table, empty where the row lacks that seed:
rectangular, and every number in it can be recomputed from those columns.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass

from fedlt.data.registry import lt_name
from fedlt.reporting.claims import check_claims, claims_section
from fedlt.reporting.collect import Collection, Row, Setting
from fedlt.reporting.environment import environment_lines
from fedlt.reporting.provenance import MIXED_MARK, by_version, code_lines, mixed
from fedlt.reporting.selection import selection_section
from fedlt.reporting.stats import PairedDiff, SeedStats, paired_difference, summarize
from fedlt.results import counted

COLUMNS = (("acc", "GM acc"), ("many_acc", "many"), ("medium_acc", "medium"), ("few_acc", "few"), ("pm_acc", "PM acc"),
           ("val_acc", "val acc"))
LATEX_HEADERS = {"acc": "GM", "many_acc": "Many", "medium_acc": "Med.", "few_acc": "Few", "pm_acc": "PM",
                 "val_acc": "Val"}
#: columns shown only where some row has them (personalized models, a validation set)
OPTIONAL_COLUMNS = ("pm_acc", "val_acc")
DELTA_HEADERS = {"acc": "Δ GM", "pm_acc": "Δ PM"}  # the columns whose difference to the reference is shown
UNRANKED_MARK = "†"
UNRESOLVED_MARK = "n.r."


@dataclass
class Table:
    setting: Setting
    columns: list[tuple[str, str]]
    cells: list[dict[str, SeedStats | None]]  # per row, per metric
    diffs: list[dict[str, PairedDiff | None]]  # per row, per metric: row - reference (None on the reference)
    marks: dict[tuple[int, str], str]  # (row index, metric) -> "best" | "second"
    reference: int  # row index

    @property
    def rows(self) -> list[Row]:
        return self.setting.rows


def build_table(setting: Setting) -> Table:
    metrics = [m for m, _ in COLUMNS]
    values = [{m: row.by_seed(m) for m in metrics} for row in setting.rows]
    cells = [{m: summarize(list(v[m].values())) if v[m] else None for m in metrics} for v in values]
    ref = setting.reference_index()
    diffs = [{m: None if i == ref else paired_difference(v[m], values[ref][m]) for m in metrics}
             for i, v in enumerate(values)]
    columns = [(m, h) for m, h in COLUMNS if m not in OPTIONAL_COLUMNS or any(c[m] for c in cells)]
    marks: dict[tuple[int, str], str] = {}
    for metric, _ in columns:
        if not metric.startswith("val_"):
            marks.update(_marks(setting.rows, metric, values, cells, diffs, ref))
    return Table(setting, columns, cells, diffs, marks, ref)


def _marks(rows: list[Row], metric: str, values: list[dict[str, dict[int, float]]],
           cells: list[dict[str, SeedStats | None]], diffs: list[dict[str, PairedDiff | None]],
           ref: int) -> dict[tuple[int, str], str]:
    """The marking rule of the module docstring, for one column."""
    # a row of fewer than 2 seeds has no interval to be ranked by: neither marked nor counted against others
    order = sorted((i for i, r in enumerate(rows) if r.ranked and len(values[i][metric]) >= 2),
                   key=lambda i: -cells[i][metric].mean)

    def leads(a: int, b: int) -> bool:  # a is above b by a resolved paired difference
        d = paired_difference(values[a][metric], values[b][metric])
        return d is not None and d.resolved and d.mean > 0

    def clear_of_ref(i: int) -> bool:
        return i == ref or (diffs[i][metric] is not None and diffs[i][metric].resolved)

    marks = {}
    if len(order) >= 2 and leads(order[0], order[1]):
        if all(leads(order[0], i) for i in order[2:]) and clear_of_ref(order[0]):
            marks[(order[0], metric)] = "best"
        if all(leads(order[1], i) for i in order[2:]) and clear_of_ref(order[1]):
            marks[(order[1], metric)] = "second"
    return marks


def _number(s: SeedStats | None, pm: str) -> str:
    if s is None:
        return "-"
    return f"{s.mean:.2f}" if s.std is None else f"{s.mean:.2f} {pm} {s.std:.2f}"


def _interval(s: SeedStats | None) -> str:
    return "-" if s is None or s.ci is None else f"[{s.ci[0]:.2f}, {s.ci[1]:.2f}]"


def _delta(t: Table, i: int, metric: str, pm: str = "±") -> str:
    """``+1.23 ±1.73 [-0.50, 2.96] n.r.``: mean paired difference to the reference, the half-width of
    its 95% interval, the interval, marker."""
    if i == t.reference:
        return "ref"
    if t.cells[i][metric] is None:
        return "-"
    d = t.diffs[i][metric]
    if d is None or d.ci is None:
        k = d.n if d is not None else 0
        return f"n/a ({k} seed{'s' * (k != 1)})"
    return (f"{d.mean:+.2f} {pm}{d.half_width:.2f} [{d.ci[0]:.2f}, {d.ci[1]:.2f}] "
            f"{'*' if d.resolved else UNRESOLVED_MARK}")


def _narrowest(t: Table, metric: str) -> tuple[PairedDiff, Row] | None:
    """The paired difference to the reference with the smallest 95% half-width in one column, and its
    row; a difference of zero variance (two rows that train alike; ``std`` is 0.0 there, float rounding
    included: :func:`fedlt.reporting.stats.paired_difference`) says nothing of the noise, so it does not count."""
    found = [(d, row) for d, row in zip((x[metric] for x in t.diffs), t.rows) if d is not None and d.std]
    return min(found, key=lambda f: f[0].half_width, default=None)


def resolution_text(t: Table) -> str:
    """What the table resolved, as achieved: ``Smallest 95% half-width of a paired difference achieved:
    Δ GM ±1.39 (Fed3R, 5 seeds); Δ PM ...``, one entry per Δ column; "" without an interval."""
    parts = []
    for metric, _ in t.columns:
        found = _narrowest(t, metric) if metric in DELTA_HEADERS else None
        if found is not None:
            d, row = found
            parts.append(f"{DELTA_HEADERS[metric]} ±{d.half_width:.2f} ({row.label}, {d.n} seeds)")
    return f"Smallest 95% half-width of a paired difference achieved: {'; '.join(parts)}" if parts else ""


def _label(row: Row) -> str:
    label = row.label + (f" {UNRANKED_MARK}" if not row.ranked else "") + (f" {MIXED_MARK}" if mixed(row) else "")
    if row.expected and len(row.runs) < row.expected:
        label += f" ({len(row.runs)}/{row.expected} seeds)"
    elif row.caption_seeds and row.runs and len(row.runs) != row.caption_seeds:  # a row of its own seeds
        label += f" ({len(row.runs)} seed{'s' * (len(row.runs) != 1)})"
    return label


def _caption_text(c: Collection) -> str:
    seeds = ", ".join(map(str, c.seeds))
    if len(c.seeds) > 1:
        spread = (f"mean ± sample std over seeds {seeds}; 95% CI: the t-interval of the mean over seeds "
                  "(mean ± t·s/√n, t the 97.5% quantile of Student's t with n - 1 degrees of freedom)")
    else:
        spread = f"one seed ({seeds}), so no std, no interval, no resolved difference and no bold or underline"
    return (f"Final-round accuracy (%): the global model (GM) on the balanced test set, overall and per shot "
            f"group, and personalized accuracy (PM: mean over clients of accuracy on local test sets drawn in each "
            f"client's training proportions) where reported; {spread}. Δ: the row minus the reference row named "
            "in the column header (the suite's `reference`, else the first row), seed by seed (the same seed gives "
            "the same partition and the same sampled clients), averaged over the seeds both have, with the 95% "
            "t-interval of those paired differences, written as ±its half-width and as the interval; `*` marks a "
            "resolved difference (the interval excludes 0: paired t-test p < 0.05), `n.r.` one not resolved (the "
            "interval holds 0: the seeds cannot tell the sign, which does not make the rows equal; a difference "
            "the same on every seed, ±0.00, is judged by the sign test, which needs 6 seeds), `n/a (k seeds)` "
            "fewer than 2 shared seeds. Under each table: the smallest half-width its paired differences achieved, "
            "where its runs were measured, and the code they ran. "
            "Per column the best is **bold** only if its lead over every other ranked row is resolved, and the "
            "second <u>underlined</u> only if its lead over every row below it is resolved too; a row whose "
            "difference to the reference is not resolved is never marked, nor one of fewer than 2 seeds, nor the "
            f"validation column. Rows marked {UNRANKED_MARK} are not ranked: upper bounds "
            "(centralized training, heads re-trained on real features: not private) and the rows a suite names "
            "unranked (controls and diagnoses, not competitors); rows "
            f"marked {MIXED_MARK} ran different code on different seeds.")


def _setting_facts(setting: Setting) -> str:
    run = setting.first_run()
    if run is None:
        return "No finished run yet."
    s = run.summary
    return (f"{lt_name(s.get('dataset', '?'))}, {counted(s.get('rounds', '?'), 'round')}; {s.get('data', '')}; "
            f"shot groups — {s.get('shot_rule', '?')}.")


def _markdown_columns(t: Table) -> list[tuple[str, str, str]]:
    """(kind, metric, header): each metric's cell, plus GM's interval and the Δ columns."""
    ref = t.rows[t.reference].label if t.rows else ""
    columns = []
    for metric, header in t.columns:
        columns.append(("cell", metric, header))
        if metric == "acc":
            columns.append(("ci", metric, "95% CI"))
        if metric in DELTA_HEADERS:
            columns.append(("delta", metric, f"{DELTA_HEADERS[metric]} vs {ref}"))
    return columns


VERDICTS = {True: "better", False: "worse"}


def verdict(t: Table, i: int) -> str:
    """The GM difference to the reference in plain words: better / worse where its 95% interval
    excludes 0, else not resolved (or why there is no interval)."""
    if i == t.reference:
        return "reference"
    if t.cells[i]["acc"] is None:  # its runs measure no global model (FedPer), not zero seeds
        return "no GM accuracy"
    d = t.diffs[i]["acc"]
    if d is None or d.ci is None:
        return f"n/a ({d.n if d else 0} seed{'s' * ((d.n if d else 0) != 1)})"
    return VERDICTS[d.mean > 0] if d.resolved else "not resolved"


def _minutes_per_run(row: Row) -> str:
    """Mean wall minutes of the row's runs; a variant shares its run's time."""
    times = [float(r.summary["elapsed_s"]) for r in row.runs if r.summary.get("elapsed_s") is not None]
    if not times:
        return "-"
    return f"{sum(times) / len(times) / 60:.1f}" + (" (its run's)" if row.variant else "")


def glance_section(tables: list[Table]) -> list[str]:
    """What a reader needs first, per setting: each row's GM difference to the reference with its
    interval and verdict, its shot groups and what one run took; empty without a reference row."""
    lines = []
    for t in tables:
        if not t.rows:
            continue
        ref = t.rows[t.reference].label
        lines += ["", *([f"**{t.setting.name}**", ""] if len(tables) > 1 else [])]
        if not t.rows[t.reference].runs:
            lines.append(f"The reference row {ref} has no finished seed, so no row has a difference; the notes "
                         "below say why.")
            continue
        lines += [f"| method | GM acc | Δ GM vs {ref} [95% CI] | verdict | many / medium / few | minutes per run |",
                  "|---|---|---|---|---|---|"]
        for i, row in enumerate(t.rows):
            if not row.runs:
                lines.append(f"| {_label(row).replace('|', '/')} | - | no finished seed (see the notes) | - | - | - |")
                continue
            shots = " / ".join("-" if t.cells[i][m] is None else f"{t.cells[i][m].mean:.1f}"
                               for m in ("many_acc", "medium_acc", "few_acc"))
            acc = t.cells[i]["acc"]
            lines.append(f"| {_label(row).replace('|', '/')} | {'-' if acc is None else f'{acc.mean:.2f}'} | "
                         f"{_delta(t, i, 'acc').removesuffix(' *').removesuffix(' ' + UNRESOLVED_MARK)} | "
                         f"{verdict(t, i)} | {shots} | {_minutes_per_run(row)} |")
    if not lines:
        return []
    return ["## At a glance", "",
            "Final-round global-model (GM) accuracy on the balanced test set, mean over seeds; Δ: the paired "
            "difference to the reference row on the same seeds with its 95% interval. Verdict: better or worse "
            "where the interval excludes 0, not resolved where it holds 0 (the seeds cannot tell the sign; that "
            "is not evidence of a tie). Shot groups: the classes with many, a medium number of and few training "
            "samples. Minutes per run: wall time of one run, mean over seeds. Details below.",
            *lines]


def markdown(c: Collection, tables: list[Table]) -> str:
    lines = [f"# {c.title}", ""]
    if c.description:
        lines += [c.description, ""]
    glance = glance_section(tables)
    if glance:
        lines += [*glance, ""]
    lines += [_caption_text(c)]
    for t in tables:
        columns = _markdown_columns(t)
        lines += ["", f"## {t.setting.name}", "", _setting_facts(t.setting), "",
                  "| method | " + " | ".join(h.replace("|", "/") for _, _, h in columns) + " |",
                  "|---|" + "---|" * len(columns)]
        for i, row in enumerate(t.rows):
            cells = []
            for kind, metric, _ in columns:
                if kind == "ci":
                    cells.append(_interval(t.cells[i][metric]))
                elif kind == "delta":
                    cells.append(_delta(t, i, metric))
                else:
                    text = _number(t.cells[i][metric], "±")
                    mark = t.marks.get((i, metric))
                    cells.append(f"**{text}**" if mark == "best" else f"<u>{text}</u>" if mark == "second" else text)
            lines.append(f"| {_label(row).replace('|', '/')} | " + " | ".join(cells) + " |")
        resolution, code = resolution_text(t), code_lines(t.setting.all_runs(), t.rows)
        lines += [*(["", resolution] if resolution else []), "", *environment_lines(t.setting.all_runs()),
                  *(["", *code] if code else [])]
        if t.setting.warnings:
            lines += ["", *(f"> note: {w}" for w in t.setting.warnings)]
    selections = selection_section(c.selections)
    if selections:
        lines += ["", *selections]
    claims = claims_section(check_claims(c), dict(COLUMNS))
    if claims:
        lines += ["", *claims]
    if c.report_messages:
        lines += ["", *messages_section(tables)]
    if c.notes:
        lines += ["", c.notes]
    if c.cost:
        lines += ["", c.cost]
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
    """One line per (setting, row), unformatted; the columns are listed in the module docstring."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    metrics = [m for m, _ in COLUMNS]
    seeds = sorted({run.seed for t in tables for row in t.rows for run in row.runs})
    fields = ("mean", "std", "ci_lo", "ci_hi", "diff", "diff_half", "diff_ci_lo", "diff_ci_hi", "diff_p", "resolved")
    writer.writerow(["setting", "row", "variant", "chosen", "ranked", "reference", "seeds", "code",
                     *(f"{m}_{k}" for m in metrics for k in (*fields, *(f"seed{s}" for s in seeds)))])
    for t in tables:
        for i, row in enumerate(t.rows):
            values = []
            for m in metrics:
                s, d, per_seed = t.cells[i][m], t.diffs[i][m], row.by_seed(m)
                ci = s.ci if s is not None and s.ci is not None else (None, None)
                d_ci = d.ci if d is not None and d.ci is not None else (None, None)
                values += [_f(s.mean if s else None), _f(s.std if s else None), _f(ci[0]), _f(ci[1]),
                           _f(d.mean if d else None), _f(d.half_width if d else None), _f(d_ci[0]), _f(d_ci[1]),
                           "" if d is None or d.p is None else f"{d.p:.4g}", "" if d is None else int(d.resolved),
                           *(_f(per_seed.get(seed)) for seed in seeds)]
            writer.writerow([t.setting.name, row.label, row.variant or "", row.chosen or "", int(row.ranked),
                             t.rows[t.reference].label, len(row.runs), "; ".join(by_version(row.runs)), *values])
    return buf.getvalue()


def _f(x: float | None) -> str:
    return "" if x is None else f"{x:.4f}"


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "†": r"$^\dagger$",
                  "‡": r"$^\ddagger$", "Δ": r"$\Delta$", "±": r"$\pm$"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def latex(c: Collection, tables: list[Table]) -> str:
    lines = [f"% {c.title}: generated by `fedlt report`; needs \\usepackage{{booktabs}}",
             f"% seeds {', '.join(map(str, c.seeds))}; best \\textbf{{bold}} and second \\underline{{underlined}} "
             "only where a paired difference over seeds resolves the order (see tables.md)"]
    for t in tables:
        ref = latex_escape(t.rows[t.reference].label) if t.rows else ""
        resolution = latex_escape(resolution_text(t))
        columns = _markdown_columns(t)
        runs = t.setting.all_runs()  # where and with what code the numbers were made, and the table's notes:
        said = [*environment_lines(runs), *code_lines(runs, t.rows), *t.setting.warnings]  # comments, not caption
        lines += [""] + [f"% {part}" for line in said for part in line.removeprefix("> ").splitlines() if part.strip()]
        lines += [r"\begin{table}[t]", r"\centering",
                  f"\\caption{{{latex_escape(c.title)}: {latex_escape(t.setting.name)}. Final-round accuracy (\\%), "
                  + (f"mean $\\pm$ std over {len(c.seeds)} seeds" if len(c.seeds) > 1 else "one seed")
                  + f"; 95\\% CI: the t-interval of GM's mean. $\\Delta$GM ($\\Delta$PM): GM (PM) minus {ref}'s, paired by seed (same partition, same sampled clients), "
                  "$\\pm$ the half-width of its 95\\% t-interval, and the interval; * the interval excludes 0, "
                  "n.r.\\ not resolved (the interval holds 0). "
                  + (resolution + ". " if resolution else "")
                  + "Best in bold only if its lead over every other ranked row is resolved, second underlined only if "
                  "its lead over every row below it is too; rows whose difference to the reference is not resolved, "
                  "rows of fewer than 2 seeds and the validation column are never marked"
                  + ("; $^\\dagger$ upper bound, not ranked" if any(not r.ranked for r in t.rows) else "")
                  + ("; $^\\ddagger$ seeds run on different code (tables.md names them)" if any(mixed(r) for r in t.rows)
                     else "") + "."
                  + "".join(f" {latex_escape(r.label)}: {latex_escape(r.chosen)}, chosen on validation data."
                            for r in t.rows if r.chosen) + "}",
                  r"\begin{tabular}{l" + "c" * len(columns) + "}", r"\toprule",
                  "Method & " + " & ".join(latex_escape(header) if kind == "delta" else "95\\% CI" if kind == "ci"
                                           else LATEX_HEADERS[metric] for kind, metric, header in columns)
                  + r" \\", r"\midrule"]
        for i, row in enumerate(t.rows):
            cells = []
            for kind, metric, _ in columns:  # the Markdown table's columns: each metric, GM's interval, the Δs
                if kind == "ci":
                    cells.append(_interval(t.cells[i][metric]))
                    continue
                if kind == "delta":
                    cells.append(_delta(t, i, metric, pm=r"$\pm$"))
                    continue
                text = _number(t.cells[i][metric], r"$\pm$")
                mark = t.marks.get((i, metric))
                cells.append(f"\\textbf{{{text}}}" if mark == "best" else f"\\underline{{{text}}}" if mark == "second"
                             else text)
            lines.append(latex_escape(_label(row)) + " & " + " & ".join(cells) + r" \\")
        lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"
