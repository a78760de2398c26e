"""Regenerate the measured parts of docs/results/reference.md from the kept cells of both machine types.

Run from the repository root after adding cells: `.venv/bin/python scripts/update_reference_page.py`.
It restores each folder's suite.yaml to the suite's full seed list (a `--seeds` run narrows it),
writes each folder's report, and replaces what lies between the page's `<!-- name -->` and
`<!-- /name -->` markers: the status line, each machine type's main table with the lines under it
(smallest half-width achieved, machine, code), the claims of both side by side, and the cost as each
folder's bench-log.jsonl measured it. The prose around them is written by hand and must be checked
against the new numbers."""
import re
import subprocess
from pathlib import Path

from fedlt.bench.suite import LOG_FILE, expand, load_suite, write_suite_file
from fedlt.reporting.cost import cpu_seconds_by_row, suite_cost

SETS = {"avx2": Path("docs/results/reference"), "avx512": Path("docs/results/reference-avx512")}
NAMES = {"avx2": "AVX2", "avx512": "AVX512"}
suite = load_suite("reference")


def block(lines, header):
    i = next(k for k, l in enumerate(lines) if l.startswith(header))
    j = i
    while j < len(lines) and lines[j].startswith("|"):
        j += 1
    return lines[i:j]


def section(lines, header):
    """The table starting at `header` and every line under it up to the next heading."""
    i = next(k for k, l in enumerate(lines) if l.startswith(header))
    j = next((k for k in range(i, len(lines)) if lines[k].startswith("## ")), len(lines))
    while lines[j - 1] == "":
        j -= 1
    return lines[i:j]


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


parts, claims, status = {}, {}, {}
for name, root in SETS.items():
    runs = root / "runs"
    write_suite_file(suite, runs, None)
    subprocess.run([".venv/bin/fedlt", "report", str(runs), "--out", str(root)], check=True, capture_output=True)
    lines = (root / "tables.md").read_text().splitlines()
    parts[f"table:{name}"] = [l for l in section(lines, "| method | GM acc | 95% CI") if "(0/" not in l]
    claims[name] = {tuple(cells(l)[:2]): cells(l) for l in block(lines, "| paper | claim")[2:]}
    done = [c for c in expand(suite, runs, None) if (c.run_dir / "summary.json").is_file()]
    rows = {}
    for c in done:
        rows.setdefault(c.method, []).append(c.seed)
    status[name] = (len(done), ", ".join(f"{m} ({','.join(map(str, sorted(s)))})" for m, s in rows.items()))


def verdict(text):
    m = re.match(r"\*\*(.+?)\*\*", text)
    return m.group(1) if m else text


def merged(va, vb, bold="**"):
    """One verdict for the claim from each machine type's ("not measured" where it has none)."""
    if "-" in (va, vb):  # a closeness claim: no adjusted verdict
        return "-"
    measured = [v for v in (va, vb) if v != "not measured"]
    if not measured:
        return va if va == vb else "not measured"
    if len(measured) == 2 and va == vb:
        return f"{bold}{va}{bold} on both"
    if len(measured) == 2:
        return f"AVX2: {va}; AVX512: {vb}"
    return f"{bold}{measured[0]}{bold} ({'AVX2' if va == measured[0] else 'AVX512'} only)"


def measurement(c):
    """measured ± half-width [interval] (p, paired seeds against the planned count)."""
    return f"{c[4]} (p {c[5]}, n {c[6]})" if verdict(c[7]) != "not measured" else "-"


merged_claims = ["| paper | claim | comparison | paper's figure | AVX2 cells | AVX512 cells | verdict | Holm | BH |",
                 "|---|---|---|---|---|---|---|---|---|"]
for key, a in claims["avx2"].items():
    b = claims["avx512"].get(key)
    column = lambda k: merged(verdict(a[k]), verdict(b[k]) if b else "not measured", bold="**" if k == 7 else "")
    merged_claims.append(f"| {a[0]} | {a[1]} | {a[2]} | {a[3]} | {measurement(a)} | {measurement(b) if b else '-'} "
                         f"| {column(7)} | {column(8)} | {column(9)} |")
parts["claims"] = merged_claims
total = len(expand(suite, SETS["avx2"] / "runs", None))
parts["status"] = [f"**Status:** AVX2 cells: {status['avx2'][0]} of the suite's {total} (rows and seeds: {status['avx2'][1]}). "
                   f"AVX512 cells: {status['avx512'][0]} (rows and seeds: {status['avx512'][1]})."]

costs = {name: suite_cost(root / "runs" / LOG_FILE) for name, root in SETS.items()}
by_row = {name: cpu_seconds_by_row(root / "runs" / LOG_FILE) for name, root in SETS.items()}
planned = {}
for c in expand(suite, SETS["avx512"] / "runs", None):
    planned[c.method] = planned.get(c.method, 0) + 1
missing = [m for m in planned if m not in by_row["avx512"]]
estimate = sum(n * sum(by_row["avx512"][m]) / len(by_row["avx512"][m]) for m, n in planned.items() if m not in missing)
parts["cost"] = [
    "Measured by each folder's `bench-log.jsonl` (the last successful record of each cell): "
    + "; ".join(f"{NAMES[n]}: {c.cells} cells, {c.cpu_s / 3600:.2f} CPU-hours, wall time "
                f"{c.cell_wall_s / c.cpu_s:.2f}x the CPU time summed over cells" for n, c in costs.items()) + ". "
    f"At the AVX512 means below, the suite's cells of the rows measured there "
    f"({sum(n for m, n in planned.items() if m not in missing)} of {total}) take about {estimate / 3600:.1f} CPU-hours"
    + (f"; {', '.join(missing)} ({sum(planned[m] for m in missing)} cells) did not run there" if missing else "")
    + ".", "",
    "| row | AVX2: CPU-minutes per cell (cells) | AVX512: CPU-minutes per cell (cells) |", "|---|---|---|",
    *(f"| {m} | " + " | ".join(f"{sum(v) / len(v) / 60:.1f} ({len(v)})" if (v := by_row[n].get(m)) else "-"
                               for n in SETS) + " |" for m in planned)]

doc = Path("docs/results/reference.md").read_text()
for name, lines in parts.items():
    pattern = re.compile(rf"(<!-- {re.escape(name)} -->\n).*?(<!-- /{re.escape(name)} -->)", re.S)
    assert pattern.search(doc), name
    doc = pattern.sub(lambda m: m.group(1) + "\n".join(lines) + "\n" + m.group(2), doc)
Path("docs/results/reference.md").write_text(doc)
print(parts["status"][0])
