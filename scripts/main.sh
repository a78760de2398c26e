#!/usr/bin/env bash
# The main job on Fashion-MNIST-LT (IF=100, Dirichlet alpha=0.5, 20 clients, 40% participation):
# FedAvg with its long-tail loss variants, FedAvg + each classifier calibration (CReFF, CCVR,
# FedNCM, Fed3R, tau-norm: one run, one backbone), FedLoGe (GM and personalized PM), the centralized
# oracle; then a comparison table.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
OUT=runs/main/$(date +%Y%m%d-%H%M%S)
for variant in "ce" "bsm" "focal" "ldam"; do
  .venv/bin/fedlt run configs/fmnist_lt.yaml loss.name=$variant run.out_dir=$OUT run.name=fedavg-$variant "$@"
done
.venv/bin/fedlt run configs/fmnist_lt.yaml method=creff "calibration=[ccvr,fedncm,fed3r,taunorm]" \
  run.out_dir=$OUT run.name=fedavg-calibrated "$@"
.venv/bin/fedlt run configs/fmnist_lt.yaml method=fedloge run.out_dir=$OUT run.name=fedloge "$@"
.venv/bin/fedlt run configs/fmnist_lt.yaml method=centralized fl.rounds=5 eval.every=1 run.out_dir=$OUT run.name=centralized-ce "$@"
.venv/bin/fedlt table $OUT/* | tee $OUT/table.md
echo "main: results in $OUT (report.md, metrics.jsonl, curves.png per run; table.md)"
