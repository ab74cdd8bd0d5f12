#!/usr/bin/env bash
# Install what the tests need, then lint and run the whole test suite on CPU.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/install.sh
echo "== ruff"
ruff check .
if [ "$#" -eq 0 ]; then
  echo "== pytest: the whole suite (about 12 minutes on an idle 2-core machine)"
else
  echo "== pytest $*"
fi
python -m pytest -q "$@"
echo "== tests done in $((SECONDS / 60)) min $((SECONDS % 60)) s"
