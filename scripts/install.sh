#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install t5ds into it.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (it only installs what is missing).
#   PYTHON=python3.11  interpreter for the venv (default: python3)
#   TORCH_SPEC=...     how to install torch when it is missing (default: torch==2.13.0; on a GPU
#                      machine pick the CUDA build you want, e.g. TORCH_SPEC="torch==2.11.0")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
# pip, minus the "Location ... is ignored" notes some pip configurations print; keeps pip's exit code.
pip_quiet() {
  set +e
  python -m pip "$@" 2>&1 | grep -v "is ignored"
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}
pip_quiet install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  # Installed first and explicitly: an unpinned `torch` requirement would pull the newest CUDA build.
  pip_quiet install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
pip_quiet install -q -e ".[dev]"
python -c "import torch, deepspeed, data_prep, training" 2>/dev/null \
  || { echo "install.sh: the environment in .venv is incomplete; see the pip output above" >&2; exit 1; }
