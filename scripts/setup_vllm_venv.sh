#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's real weight loaders on CPU, in an environment of their own
# (vLLM's transformers range does not overlap Megatron-Bridge's). Idempotent.
#
# vllm 0.33.0 requires certifi>=2026.10.19, which the package registry here may lack: its
# other requirements are installed from its own metadata with certifi relaxed, then the
# wheel itself with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
STAMP="$VENV/.setup-stamp"
# pyproject.toml too: the editable install carries its entry points (the vLLM plugin)
want="vllm==$VLLM_VERSION $(cat scripts/setup_vllm_venv.sh pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then exit 0; fi
PY=$(.venv/bin/python -c 'import sys; print(sys.executable)' 2>/dev/null || true)
[ -n "$PY" ] || { echo "setup_vllm_venv: run 'make setup' first (needs the Python 3.12 of .venv)" >&2; exit 1; }
BASE=$("$PY" -c 'import sys; print(sys.base_prefix)')/bin/python3
[ -x "$VENV/bin/python" ] || "$BASE" -m venv "$VENV"
PIP="$VENV/bin/pip --disable-pip-version-check -q"
$PIP install --upgrade pip
tmp=$(mktemp -d)
$PIP download --no-deps -d "$tmp" "vllm==$VLLM_VERSION"
wheel=$(ls "$tmp"/vllm-*.whl)
"$VENV/bin/python" - "$wheel" > "$tmp/reqs.txt" <<'PY'
import sys, zipfile, re
from email.parser import Parser
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
msg = Parser().parsestr(z.read(meta).decode())
for req in msg.get_all("Requires-Dist") or []:
    if "extra ==" in req:
        continue
    req = req.split(";")[0].strip()
    if req.startswith("certifi"):
        req = "certifi"
    print(req)
PY
$PIP install -r "$tmp/reqs.txt" pytest
$PIP install --no-deps "$wheel"
$PIP install --no-deps -e .
rm -rf "$tmp"
echo "$want" > "$STAMP"
echo "setup_vllm_venv: done ($VENV)"
