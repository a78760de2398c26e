#!/usr/bin/env bash
# Runs the test suite (installing first if needed). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
.venv/bin/python -m pytest "$@"
