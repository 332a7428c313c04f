#!/usr/bin/env bash
# Creates .venv from Python 3.12 and installs the project (idempotent: a stamp file
# records the inputs' hash; a second run with the same inputs does nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.setup-stamp"
hash=$(cat pyproject.toml requirements/megatron.txt requirements/mamba.txt scripts/setup_venv.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$hash" ]; then
  exit 0
fi

find_python312() {
  local cand root cands=(python3.12)
  # pyenv's 3.12 also when the pyenv command is not on PATH (as in a bare CI shell)
  for root in "${PYENV_ROOT:-$HOME/.pyenv}" $(command -v pyenv >/dev/null 2>&1 && pyenv root); do
    cands+=("$root"/versions/3.12*/bin/python3)
  done
  cands+=(/usr/bin/python3.12 /usr/local/bin/python3.12)
  for cand in "${cands[@]}"; do
    [ -n "$cand" ] || continue
    if "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      echo "$cand"; return 0
    fi
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python312) || {
    echo "setup: no Python 3.12 found (megatron-core 0.19 needs >=3.12)." >&2
    echo "setup: install one (e.g. 'pyenv install 3.12') or put python3.12 on PATH." >&2
    exit 1
  }
  echo "setup: creating $VENV with $PY"
  scripts/need_disk.sh 7 "the main venv ($VENV, ~6 GiB)"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/pip --disable-pip-version-check -q"
$PIP install --upgrade pip
# Project + its resolvable dependencies (torch, transformers in Bridge's range, test tools,
# matplotlib for the charts).
$PIP install -e '.[megatron,test,plots]'
# Megatron pins without their dependency lists (Bridge's full list is neither needed nor
# installable on CPU machines); see README "Why two install steps".
$PIP install --no-deps -r requirements/megatron.txt
# mamba-ssm and causal-conv1d (Nemotron-H) without their CUDA extensions: pure-Python builds
# against the venv's torch (no build isolation); FORCE_BUILD stops setup.py from fetching a
# prebuilt CUDA wheel. Each package reads only its own two variables.
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE \
  $PIP install --no-build-isolation --no-deps -r requirements/mamba.txt
# the same torch / nvidia-* files in every project venv held once (hard links; scripts/link_venvs.py)
"$VENV/bin/python" scripts/link_venvs.py "$VENV" .venv .venv-vllm .venv-vllm-cpu .venv-sglang
echo "$hash" > "$STAMP"
echo "setup: done ($VENV)"
