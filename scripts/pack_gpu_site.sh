#!/usr/bin/env bash
# Pack what a bare GPU machine (torch + CUDA, no Megatron) lacks for `make gpu-check`: the pinned
# Megatron-Core / Bridge / transformers / tokenizers / omegaconf / pydantic and the pure-Python
# mamba builds, copied from .venv (x86-64, Python 3.12) into .devsite/site.tar.gz (~18 MB).
# There: tar -xzf .devsite/site.tar.gz -C /tmp/site; PYTHONPATH=/tmp/site:$PWD; .venv/bin/python
# a two-line shell script that execs python3; then python3 scripts/gpu_checks.py (BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p .devsite
packages=(megatron omegaconf pydantic pydantic_core annotated_types typing_inspection transformers tokenizers
          causal_conv1d mamba_ssm)
dists=(megatron_core megatron_bridge omegaconf pydantic pydantic_core annotated_types typing_inspection transformers
       tokenizers causal_conv1d mamba_ssm)
names=("${packages[@]}")
for d in "${dists[@]}"; do names+=("$(cd "$site" && ls -d "$d"-*.dist-info)"); done
tar --exclude=__pycache__ -czf .devsite/site.tar.gz -C "$site" "${names[@]}"
ls -la .devsite/site.tar.gz
