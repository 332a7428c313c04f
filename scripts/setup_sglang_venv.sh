#!/usr/bin/env bash
# Creates .venv-sglang: SGLang's real model classes and weight updater on CPU, in an
# environment of their own (SGLang pins transformers 5.19, outside Megatron-Bridge's range).
# Idempotent.
#
# sglang's own dependency list names CUDA-only wheels (flashinfer, flash-attn-4, deep-gemm,
# sglang-kernel, ...): requirements/sglang.txt lists what its CPU import path needs, installed
# with dependencies, then sglang itself with --no-deps, then this project (editable, no deps).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_VENV:-.venv-sglang}
REQS=requirements/sglang.txt
STAMP="$VENV/.setup-stamp"
want=$(cat "$REQS" scripts/setup_sglang_venv.sh pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then exit 0; fi
PY=$(.venv/bin/python -c 'import sys; print(sys.executable)' 2>/dev/null || true)
[ -n "$PY" ] || { echo "setup_sglang_venv: run 'make setup' first (needs the Python 3.12 of .venv)" >&2; exit 1; }
BASE=$("$PY" -c 'import sys; print(sys.base_prefix)')/bin/python3
# its install's peak, torch and its dependencies seeded from .venv (below): 0.8 GiB (2026-11-29)
[ -x "$VENV/bin/python" ] || scripts/need_disk.sh 2 "the SGLang venv ($VENV)"
[ -x "$VENV/bin/python" ] || "$BASE" -m venv "$VENV"
echo '*' > "$VENV/.gitignore"  # as Python 3.13's venv writes: git leaves the venv alone
PIP="$VENV/bin/pip --disable-pip-version-check -q"
$PIP install --upgrade pip
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
grep -viE '^sglang([=<>~! ]|$)' "$REQS" > "$tmp/deps.txt"
grep -iE '^sglang([=<>~! ]|$)' "$REQS" > "$tmp/sglang.txt"
# torch and its nvidia-* / triton dependencies hard-linked from .venv (the same pin) before pip runs
# (scripts/seed_venv.py): pip finds them installed, so this venv's install peaks at 0.8 GiB, not ~7
"$PY" scripts/seed_venv.py "$VENV" "$(grep -E '^torch==' "$REQS")" --from .venv .venv-vllm .venv-vllm-cpu
$PIP install -r "$tmp/deps.txt"
$PIP install --no-deps -r "$tmp/sglang.txt"
$PIP install --no-deps -e .
# the same torch / nvidia-* files in every project venv held once (hard links; scripts/link_venvs.py)
"$VENV/bin/python" scripts/link_venvs.py "$VENV" .venv .venv-vllm .venv-vllm-cpu .venv-sglang
echo "$want" > "$STAMP"
echo "setup_sglang_venv: done ($VENV)"
