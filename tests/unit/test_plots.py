"""The chart writers of ``bench_refit.py --png`` and ``grpo_tiny.py --png`` write valid PNGs."""

from __future__ import annotations

import pytest

from megatron_refit.tools.plots import bench_chart, grpo_chart, time_unit

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _read_png(path):
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    return imread(path)


def test_bench_chart_writes_a_png(tmp_path):
    rows = [dict(layout="train TP2 -> gen TP2", seconds=dict(ours=0.34, gather_broadcast=2.89, floor=0.22)),
            dict(layout="train TP2 -> gen TP1xDP2", seconds=dict(ours=0.60, gather_broadcast=2.56, floor=0.39))]
    bench_chart(rows, str(tmp_path / "bench.png"))
    image = _read_png(tmp_path / "bench.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_grpo_chart_writes_a_png(tmp_path):
    grpo_chart([0.02, 0.01, 0.01], [0.1, 0.4, 0.9], str(tmp_path / "grpo.png"))
    assert _read_png(tmp_path / "grpo.png").shape[1] > 100


def test_time_axis_unit_follows_the_values():
    # the GRPO example's refits take milliseconds: its axis must not say seconds
    assert time_unit([0.0035, 0.0066]) == (1e3, "ms")
    assert time_unit([0.34, 2.89]) == (1.0, "s")


def test_charts_refuse_bad_input(tmp_path):
    with pytest.raises(ValueError, match="at least one row"):
        bench_chart([], str(tmp_path / "x.png"))
    with pytest.raises(ValueError, match=r"lacks seconds for \['floor'\]"):
        bench_chart([dict(layout="a", seconds=dict(ours=1, gather_broadcast=2))], str(tmp_path / "x.png"))
    with pytest.raises(ValueError, match="got 2 and 3"):
        grpo_chart([1, 2], [0, 1, 2], str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()
