#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install t5ds into it, one line per
# stage. Sourced by scripts/demo.sh and scripts/test.sh. Running it again does nothing while
# setup.cfg and pyproject.toml are unchanged since the last complete install (delete .venv to start over).
#   PYTHON=python3.11  interpreter for the venv (default: python3)
#   TORCH_SPEC=...     how to install torch when it is missing, taken as given, pip options included,
#                      e.g. TORCH_SPEC="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128"
# Without TORCH_SPEC it installs torch==2.13.0 as pip resolves it, except that where pip would take a
# CUDA build and this machine has no NVIDIA GPU it takes the CPU build from PyTorch's CPU wheel index,
# and says so (scripts/choose_torch.py decides).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TORCH_DEFAULT="torch==2.13.0"
CPU_INDEX="https://download.pytorch.org/whl/cpu"
install_started=$SECONDS
say() { echo "== install: $*"; }
# pip with its stderr minus the "Location ... is ignored" notes some pip configurations print; stdout,
# where pip draws its progress bars, goes straight to the terminal. Returns pip's exit code.
pip_() {
  local rc errexit=0
  [[ $- == *e* ]] && errexit=1
  set +e
  { python -m pip "$@" 2>&1 1>&3 3>&- | grep -v "is ignored" >&2; rc=${PIPESTATUS[0]}; } 3>&1
  ((errexit)) && set -e
  return "$rc"
}
installed() { python -c "import torch, deepspeed, data_prep, training" >/dev/null 2>&1; }

if [ ! -x .venv/bin/python ]; then
  say "creating the virtual environment .venv (${PYTHON:-python3})"
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/t5ds-install.sha256
want="$(cat setup.cfg pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && installed; then
  say ".venv is up to date"
else
  say "upgrading pip"
  pip_ install -q --upgrade pip
  if ! python -c "import torch" 2>/dev/null; then
    if [ -n "${TORCH_SPEC:-}" ]; then
      say "torch: $TORCH_SPEC (TORCH_SPEC)"
      # shellcheck disable=SC2086  # TORCH_SPEC may carry pip options
      pip_ install --progress-bar on $TORCH_SPEC
    else
      say "torch: asking pip which build of $TORCH_DEFAULT it would install"
      report="$(mktemp)"
      pip_ install --dry-run --quiet --report "$report" "$TORCH_DEFAULT"
      action="" build="" what=""
      IFS=$'\t' read -r action build what < <(python scripts/choose_torch.py decide "$report") || true
      # A CPU build's few small dependencies come with the project's; a CUDA build's large ones now,
      # with pip's progress bars.
      deps=()
      [ "$build" = cpu ] && deps=(--no-deps)
      case "$action" in
        take)
          say "torch: $what"
          pip_ install --progress-bar on ${deps[@]+"${deps[@]}"} "$TORCH_DEFAULT"
          ;;
        cpu-index)
          say "torch: pip would take $what, and this machine has no NVIDIA GPU: trying PyTorch's CPU wheel index"
          # A short timeout and no retries: where that index is unreachable this fails in seconds (or
          # resolves to a build the pip configuration's other sources offer, which does not count).
          if pip_ install --dry-run --quiet --no-deps --timeout 10 --retries 0 --index-url "$CPU_INDEX" \
            --report "$report.cpu" "$TORCH_DEFAULT" 2>/dev/null &&
            python scripts/choose_torch.py cpu-index "$report.cpu"; then
            say "torch: the CPU build from $CPU_INDEX"
            pip_ install --progress-bar on --no-deps --index-url "$CPU_INDEX" "$TORCH_DEFAULT"
          else
            say "torch: $CPU_INDEX is unreachable; downloading $what from the default index instead:" \
              "$(python scripts/choose_torch.py size "$report") (set TORCH_SPEC to choose another build)"
            pip_ install --progress-bar on "$TORCH_DEFAULT"
          fi
          ;;
        *)
          echo "install.sh: scripts/choose_torch.py could not read pip's report; see above" >&2
          exit 1
          ;;
      esac
      rm -f "$report" "$report.cpu"
    fi
  fi
  say "t5ds and its dependencies (pip install -e \".[dev]\"; minutes on a fresh machine)"
  # The one warning filtered: setuptools' note that an editable install can be shadowed by a folder
  # of the same name in the working directory (the checkout is that folder).
  PYTHONWARNINGS="ignore:Editable installation" pip_ install -q -e ".[dev]"
  if ! installed; then
    echo "install.sh: torch, deepspeed or t5ds does not import in .venv:" >&2
    python -c "import torch, deepspeed, data_prep, training" >/dev/null || true
    exit 1
  fi
  echo "$want" >"$stamp"
  say "done in $((SECONDS - install_started)) s: $(python -c 'import torch; print("torch", torch.__version__)')"
fi
