#!/usr/bin/env bash
# Installs everything fedlt needs on a fresh Debian-like machine, idempotently:
#   - Fashion-MNIST (Debian package dataset-fashion-mnist; else a download into data/ when online)
#   - a virtual environment in .venv with the CPU build of torch 2.13.0 and fedlt[test,docs]
# Sourced by scripts/main.sh and scripts/test.sh; safe to run again (it skips what is done).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export FLWR_TELEMETRY_ENABLED=0

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

FMNIST_DEB=/usr/share/datasets/fashion-mnist
if [ ! -f "$FMNIST_DEB/train-images-idx3-ubyte.gz" ] && [ ! -f "$ROOT/data/fashion-mnist/train-images-idx3-ubyte.gz" ]; then
  echo "setup: installing Fashion-MNIST (Debian package dataset-fashion-mnist)" >&2
  if ! { as_root apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 ||
         { as_root apt-get update -q >/dev/null 2>&1 && as_root apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1; }; }; then
    echo "setup: apt failed; downloading Fashion-MNIST into data/fashion-mnist" >&2
    mkdir -p data/fashion-mnist
    for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
      python3 -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" \
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/$f.gz" "data/fashion-mnist/$f.gz.part" &&
        mv "data/fashion-mnist/$f.gz.part" "data/fashion-mnist/$f.gz"
    done
  fi
fi
if [ ! -f "$FMNIST_DEB/train-images-idx3-ubyte.gz" ] && [ -f "$ROOT/data/fashion-mnist/train-images-idx3-ubyte.gz" ]; then
  export FEDLT_DATA="${FEDLT_DATA:-$ROOT/data}"
fi

PY=python3
if ! $PY -c "import venv, ensurepip" 2>/dev/null; then
  echo "setup: installing python3-venv" >&2
  as_root apt-get update -q >/dev/null
  as_root apt-get install -y -q python3-venv python3-pip >/dev/null
fi
STAMP=".venv/.fedlt-installed"
WANT="$(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -x .venv/bin/python ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "setup: creating .venv (torch 2.13.0 CPU, fedlt[test,docs])" >&2
  [ -x .venv/bin/python ] || $PY -m venv .venv
  pip_install() {  # quiet, minus the warnings this machine's pip config prints for absent mirrors
    .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2)
  }
  pip_install --upgrade pip >/dev/null
  # PyPI's Linux torch is the multi-GB CUDA build: use PyTorch's CPU index when it is reachable
  # (FEDLT_TORCH_INDEX overrides); mirrors that already serve a CPU build need nothing extra.
  TORCH_INDEX="${FEDLT_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
  if .venv/bin/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" \
       "$TORCH_INDEX" 2>/dev/null; then
    pip_install "torch==2.13.0" --extra-index-url "$TORCH_INDEX"
  else
    pip_install "torch==2.13.0"
  fi
  pip_install -e ".[test,docs]"
  echo "$WANT" > "$STAMP"
fi
