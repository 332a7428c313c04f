"""The machine a benchmark ran on, as its JSON names it (every time reported names its CPU)."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name and the cores this process may use, e.g. ``AMD EPYC (2 cores)``."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "unknown CPU"
    return f"{name} ({len(os.sched_getaffinity(0))} cores)"
