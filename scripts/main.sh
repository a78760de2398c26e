#!/usr/bin/env bash
# The main job: the built-in `demo` suite (fedlt's headline methods on Fashion-MNIST-LT, IF=100,
# Dirichlet alpha=0.5, 20 clients, 40% participation, 25 rounds; src/fedlt/bench/suites/demo.yaml),
# two cells at a time, then its report: comparison table (Markdown, CSV, LaTeX; printed) and plots.
# Extra key=value arguments apply to every cell; a re-run skips finished cells.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
OUT=runs/main
.venv/bin/fedlt bench demo --workers 2 --out $OUT "$@"   # prints the table, writes $OUT/report/
echo "main: table in $OUT/report/tables.md, plots in $OUT/report/, one run directory per cell under $OUT"
