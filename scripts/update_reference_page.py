"""Regenerate the measured parts of docs/results/reference.md from the kept cells of both machine types.

Run from the repository root after adding cells: `.venv/bin/python scripts/update_reference_page.py`.
It restores each folder's suite.yaml to the suite's full seed list (a `--seeds` run narrows it),
writes each folder's report, and replaces what lies between the page's `<!-- name -->` and
`<!-- /name -->` markers: the status line, each machine type's main table, and the claims of both
side by side. The prose around them is written by hand and must be checked against the new numbers."""
import re
import subprocess
from pathlib import Path
from fedlt.bench.suite import load_suite, write_suite_file, expand

SETS = {"avx2": Path("docs/results/reference"), "avx512": Path("docs/results/reference-avx512")}
suite = load_suite("reference")

def block(lines, header):
    i = next(k for k, l in enumerate(lines) if l.startswith(header))
    j = i
    while j < len(lines) and lines[j].startswith("|"):
        j += 1
    return lines[i:j]

def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]

parts, claims, status = {}, {}, {}
for name, root in SETS.items():
    runs = root / "runs"
    write_suite_file(suite, runs, None)
    subprocess.run([".venv/bin/fedlt", "report", str(runs), "--out", str(root)], check=True, capture_output=True)
    lines = (root / "tables.md").read_text().splitlines()
    table = [l for l in block(lines, "| method | GM acc") if "(0/" not in l]
    env = next((l for l in lines if l.startswith("Measured on:") or l.startswith("> note: cells of this table")), "")
    parts[f"table:{name}"] = table + ["", env]
    claims[name] = {tuple(cells(l)[:2]): cells(l) for l in block(lines, "| paper | claim")[2:]}
    done = [c for c in expand(suite, runs, None) if (c.run_dir / "summary.json").is_file()]
    rows = {}
    for c in done:
        rows.setdefault(c.method, []).append(c.seed)
    status[name] = (len(done), ", ".join(f"{m} ({','.join(map(str, sorted(s)))})" for m, s in rows.items()))

def verdict(text):
    m = re.match(r"\*\*(.+?)\*\*", text)
    return m.group(1) if m else text

merged = ["| paper | claim | comparison | paper's figure | AVX2 cells | AVX512 cells | verdict |", "|---|---|---|---|---|---|---|"]
for key, a in claims["avx2"].items():
    b = claims["avx512"].get(key)
    va, vb = verdict(a[5]), verdict(b[5]) if b else "not measured"
    measured = [v for v in (va, vb) if v != "not measured"]
    if not measured:
        final = "not measured"
    elif len(measured) == 2 and va == vb:
        final = f"**{va}** on both"
    elif len(measured) == 2:
        final = f"AVX2: {va}; AVX512: {vb}"
    else:
        final = f"**{measured[0]}** ({'AVX2' if va != 'not measured' else 'AVX512'} only)"
    show = lambda c: c[4] if verdict(c[5]) != "not measured" else "-"
    merged.append(f"| {a[0]} | {a[1]} | {a[2]} | {a[3]} | {show(a)} | {show(b) if b else '-'} | {final} |")
parts["claims"] = merged
total = len(expand(suite, SETS["avx2"] / "runs", None))
parts["status"] = [f"**Status:** AVX2 cells: {status['avx2'][0]} of the suite's {total} (rows and seeds: {status['avx2'][1]}). "
                   f"AVX512 cells: {status['avx512'][0]} (rows and seeds: {status['avx512'][1]})."]

doc = Path("docs/results/reference.md").read_text()
for name, lines in parts.items():
    pattern = re.compile(rf"(<!-- {re.escape(name)} -->\n).*?(<!-- /{re.escape(name)} -->)", re.S)
    assert pattern.search(doc), name
    doc = pattern.sub(lambda m: m.group(1) + "\n".join(lines) + "\n" + m.group(2), doc)
Path("docs/results/reference.md").write_text(doc)
print(parts["status"][0])
