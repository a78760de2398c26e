#!/usr/bin/env bash
# The main job: the built-in `demo` suite (FedAvg, FedAvg (BSM) and the five seed methods on
# Fashion-MNIST-LT, the reference protocol's kind at 5 rounds x 1 epoch, seeds 0-2, paired with FedAvg;
# src/fedlt/bench/suites/demo.yaml), two cells at a time, then its report: a glance table (paired
# difference to FedAvg, interval, verdict), the detailed tables (Markdown, CSV, LaTeX; printed) and plots.
# Extra key=value arguments apply to every cell; a re-run skips finished cells.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
OUT=runs/main
.venv/bin/fedlt bench demo --workers 2 --out $OUT "$@"   # prints the table, writes $OUT/report/
echo "main: table in $OUT/report/tables.md, plots in $OUT/report/, one run directory per cell under $OUT"
