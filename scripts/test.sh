#!/usr/bin/env bash
# Checks the import layering (lint-imports), then runs the test suite (installing first if
# needed). The tests run in one worker process per core (pytest-xdist, at most 4); extra arguments go
# to pytest, and a later -n overrides (-n 0: one process, as pdb and -s need).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
.venv/bin/lint-imports --no-logo --no-cache  # the layering contracts of pyproject.toml
.venv/bin/python -m pytest -n auto --maxprocesses 4 "$@"
