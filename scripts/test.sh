#!/usr/bin/env bash
# Install what the tests need, then lint and run the whole test suite on CPU.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/install.sh
echo "== ruff"
ruff check .
echo "== pytest"
python -m pytest -q "$@"
