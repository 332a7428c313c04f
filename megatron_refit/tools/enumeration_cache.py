"""The dry run's enumeration cache: every representative train rank's ShardSpecs of a model and
layout (:mod:`conversion.derive`), built on the meta device in a child process (``python
-m conversion.testing.enumerate``: it imports Megatron, about 1 s per rank) and written beside the
config (``configs/cache/``), keyed by what decides them: the preset, the layout, the dtype, the
package versions and the sources that enumerate."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from importlib import metadata

from conversion.derive import CACHE_FORMAT, load_specs
from megatron_refit.plan.layout import TrainLayout

VERSIONED = ("megatron-core", "megatron-bridge", "transformers", "torch")
"""Packages whose versions key the enumeration cache."""


def _versions() -> dict[str, str]:
    out = {}
    for package in VERSIONED:
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "absent"
    return out


ENUMERATION_SOURCES = ("__init__.py", "bridge_api.py", "context_parallel.py", "cpu_shim.py", "local_shards.py",
                       "mamba_shim.py", "presets.py", "te_shim.py", "validate.py", "testing/build.py",
                       "testing/core_attention.py", "testing/deepseek_v3_build.py", "testing/enumerate.py",
                       "testing/families.py", "testing/meta.py", "testing/nemotron_h_build.py")
"""The ``conversion`` modules that decide how ranks are enumerated (LoRA, FP8 and training
helpers do not); the family tables (``megatron_refit/families/``) do too. The trainer layout's
fields are in the key itself; which layers a rank builds is Megatron's to decide."""


def _enumeration_sources() -> str:
    """sha256 of those sources (read, not imported): any change to how ranks are
    enumerated makes old caches stale."""
    import conversion

    digest = hashlib.sha256()
    folder = os.path.dirname(conversion.__file__)
    tables = os.path.join(os.path.dirname(os.path.dirname(__file__)), "families")
    paths = [os.path.join(folder, name) for name in ENUMERATION_SOURCES]
    paths += sorted(os.path.join(tables, name) for name in os.listdir(tables) if name.endswith(".py"))
    for path in paths:  # a listed source that is gone is an error: the key would stop seeing it
        name = os.path.relpath(path, os.path.dirname(folder))
        with open(path, "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


def cache_key(model: str, preset: dict, layout: TrainLayout, dtype: str) -> str:
    """Key of an enumeration cache: preset, layout, dtype, package versions, conversion sources."""
    text = json.dumps({"format": CACHE_FORMAT, "model": model, "preset": preset, "layout": asdict(layout),
                       "dtype": dtype, "versions": _versions(), "sources": _enumeration_sources()},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ensure_cache(path: str, model: str, layout: TrainLayout, key: str, dtype: str) -> float:
    """Enumerate into ``path`` in a child process unless a cache with ``key`` is there; seconds spent."""
    if os.path.exists(path):
        try:
            load_specs(path, key)
            return 0.0
        except ValueError:
            pass  # stale (other versions or format): enumerate again
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    start = time.perf_counter()
    tmp = f"{path}.{os.getpid()}.tmp"
    layout_json = json.dumps({k: v for k, v in asdict(layout).items() if v is not None})
    try:
        subprocess.run([sys.executable, "-m", "conversion.testing.enumerate", "--model", model, "--layout", layout_json,
                        "--dtype", dtype, "--key", key, "--out", tmp], check=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # the enumeration failed: leave no partial file behind
            os.remove(tmp)
    return time.perf_counter() - start
