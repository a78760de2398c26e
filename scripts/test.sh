#!/usr/bin/env bash
# Checks the import layering (lint-imports), then runs the test suite (installing first if
# needed). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
.venv/bin/lint-imports --no-logo --no-cache  # the layering contracts of pyproject.toml
.venv/bin/python -m pytest "$@"
