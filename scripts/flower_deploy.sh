#!/usr/bin/env bash
# A real Flower deployment on this machine: a SuperLink and N SuperNodes on 127.0.0.1 run a fedlt
# config and are stopped afterwards (every process, by id). Each SuperNode gets
# --node-config "partition-id=I num-partitions=N" and trains only its own clients (k % N == I).
#   scripts/flower_deploy.sh [--nodes 3] [--tls] [--workdir runs/deploy] CONFIG [key=value ...]
# --tls makes a throw-away CA and a 127.0.0.1 certificate with openssl; without it: --insecure.
# Each SuperNode runs --isolation process beside one ClientApp process that serves all its messages
# (python -m fedlt.engine.flower_worker). Logs of the SuperLink, each SuperNode and each ClientApp
# process go to the workdir; the run directory to run.out_dir.
# Exit code: 0 finished; 1 the run failed (one "fedlt: error:" line says why; an aborted run still
# writes summary.json with "status": "aborted"); 2 config refused before anything started;
# 130/143 stopped by SIGINT/SIGTERM. No process of the deployment outlives it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${FEDLT_PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m fedlt.deploy "$@"
