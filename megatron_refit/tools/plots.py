"""PNG charts of the benchmark and the GRPO example (matplotlib: the ``plots`` extra).

Imported by ``scripts/bench_refit.py --png`` and ``scripts/grpo_tiny.py --png``; matplotlib
is imported only when a chart is drawn, so the package itself never needs it.
"""

from __future__ import annotations

SERIES = (("ours", "ours (shard to shard)"), ("gather_broadcast", "gather + broadcast"), ("floor", "transport floor"))
"""Benchmark keys of ``row["seconds"]`` and their legend labels, in bar order."""


def require_matplotlib() -> None:
    """``SystemExit`` with the install command when matplotlib is missing (check before a long run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("error: --png needs matplotlib: pip install -e '.[plots]' (make setup installs it)") from None


def time_unit(seconds: list[float]) -> tuple[float, str]:
    """The factor and unit to show ``seconds`` in: ms when all are below one second."""
    return (1e3, "ms") if max(seconds) < 1.0 else (1.0, "s")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def bench_chart(rows: list[dict], path: str, title: str = "") -> None:
    """Grouped bars per layout: median seconds of ours, gather + broadcast and the floor.

    ``rows``: ``scripts/bench_refit.run_bench`` results (``layout``, ``seconds``).
    """
    if not rows:
        raise ValueError("bench_chart needs at least one row, got none")
    for row in rows:
        missing = [key for key, _ in SERIES if key not in row.get("seconds", {})]
        if missing or "layout" not in row:
            raise ValueError(f"bench_chart: row {row.get('layout', '?')!r} lacks seconds for {missing} or a layout")
    plt = _pyplot()
    scale, unit = time_unit([row["seconds"][key] for row in rows for key, _ in SERIES])
    width = 0.8 / len(SERIES)
    fig, ax = plt.subplots(figsize=(2.2 + 2.6 * len(rows), 3.6))
    for i, (key, label) in enumerate(SERIES):
        xs = [j + (i - (len(SERIES) - 1) / 2) * width for j in range(len(rows))]
        values = [row["seconds"][key] * scale for row in rows]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8, padding=2)
    ax.set_xticks(range(len(rows)), [row["layout"] for row in rows], fontsize=8)
    ax.set_ylabel(f"{unit} per refit (median)")
    ax.set_ylim(0, 1.15 * scale * max(row["seconds"][key] for row in rows for key, _ in SERIES))
    ax.set_title(title or "refit: ours vs gather + broadcast vs transport floor", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def grpo_chart(refit_seconds: list[float], rewards: list[float], path: str) -> None:
    """Refit seconds (bars; the slowest rank's ``RefitReport`` total) and mean reward (line) per GRPO step."""
    if not refit_seconds or len(refit_seconds) != len(rewards):
        raise ValueError(f"grpo_chart needs one refit time and one reward per step, got {len(refit_seconds)} and "
                         f"{len(rewards)}")
    plt = _pyplot()
    steps = range(1, len(rewards) + 1)
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    scale, unit = time_unit(refit_seconds)
    ax[0].bar(steps, [v * scale for v in refit_seconds])
    ax[0].set(title="refit time per step (slowest rank)", xlabel="step", ylabel=unit)
    ax[1].plot(steps, rewards, marker="o")
    ax[1].set(title="mean reward per step", xlabel="step", ylim=(-0.05, 1.05))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
