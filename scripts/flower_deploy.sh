#!/usr/bin/env bash
# `fedlt deploy` from a checkout (see `fedlt deploy --help` and docs/flower.md): a real Flower
# deployment on this machine, a SuperLink and N SuperNodes on 127.0.0.1 that run a fedlt config
# and are stopped afterwards (every process, by id).
#   scripts/flower_deploy.sh [--nodes 3 | --node-data DIR [--server-test DIR]] [--tls [--auth]]
#                            [--workdir runs/deploy] [--timeout S] CONFIG [key=value ...]
# Exit code: 0 finished; 1 the run failed (one "fedlt: error:" line says why); 2 input refused
# before anything started; 130/143 stopped by SIGINT/SIGTERM. No process outlives it.
# This wrapper only picks the checkout's Python and sources; the command is fedlt.cli's.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${FEDLT_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
"$PY" -c "import torch, flwr" 2>/dev/null || {
  echo "fedlt: error: $PY cannot import torch and flwr: run 'source scripts/setup.sh' first (it creates .venv), or set FEDLT_PYTHON to a Python that has fedlt's packages" >&2
  exit 2; }
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m fedlt.cli deploy "$@"
