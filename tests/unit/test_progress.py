"""Progress bars are silent off a terminal; a refit's metrics carry what a loop logs."""

from __future__ import annotations

import io
import json
import logging
from types import SimpleNamespace

import pytest

from megatron_refit.local.progress import Bar, on_terminal
from megatron_refit.endpoint.report import RefitReport


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_is_silent_off_a_terminal():
    out, err = io.StringIO(), io.StringIO()
    bar = Bar(range(5), desc="refit", delay=0, streams=(out, err))
    items = list(bar)
    bar.show(reward=1.0)
    assert items == [0, 1, 2, 3, 4] and not bar.active
    assert out.getvalue() == err.getvalue() == ""
    # one terminal is not enough: output redirected anywhere means no bar
    assert not on_terminal((_Tty(), io.StringIO())) and not on_terminal((io.StringIO(), _Tty()))


def test_bar_draws_on_a_terminal():
    pytest.importorskip("tqdm")
    out, err = _Tty(), _Tty()
    bar = Bar(range(3), desc="refit", delay=0, streams=(out, err))
    for _ in bar:
        bar.on_report({"refit/total_s": 2.0, "refit/gbps": 1.0})
    assert bar.active and list(bar) == [0, 1, 2]
    assert "refit" in err.getvalue() and "gbps=1.00" in err.getvalue() and out.getvalue() == ""


def test_bar_waits_for_its_delay():
    pytest.importorskip("tqdm")
    err = _Tty()
    bar = Bar(range(3), desc="refit", delay=60, streams=(_Tty(), err))
    for i in bar:
        bar.show(step=i)
    assert bar.active and err.getvalue() == ""


def test_refit_metrics_and_log_line(caplog):
    from megatron_refit.endpoint.base import Endpoint
    from megatron_refit.endpoint.report import SUMMARY_KEYS, report_values, summarize

    report = RefitReport(version=7, role="gen", rank=3, bytes_received=3_000_000, bytes_wire=3_000_016,
                         bytes_minimal=6_000_000)
    report.seconds.update(total=0.5, transfer=0.4, load=0.1)
    report.paths["direct"] = 2
    train = RefitReport(version=7, role="train", rank=0, bytes_sent=6_000_000, bytes_wire=6_000_032,
                        bytes_minimal=6_000_000)
    train.seconds.update(total=0.25, pack=0.05, onload=0.01)
    train.paths.update(direct=2, packed=1)
    rows = [report_values(train, False), report_values(RefitReport(7, "gen", 1), True), report_values(report, False)]
    report.summary = summarize(7, rows, 1, 6_000_000)
    seen = []
    with caplog.at_level(logging.INFO, logger="megatron_refit"):
        Endpoint._emit(SimpleNamespace(on_report=seen.append, group=SimpleNamespace(rank=3)), report)
    metrics = seen[0]
    assert tuple(metrics) == SUMMARY_KEYS
    assert metrics["refit/version"] == 7 and metrics["refit/ok"] == 0 and metrics["refit/failed_ranks"] == 1
    assert metrics["refit/total_s"] == 0.5 and metrics["refit/slowest_rank"] == 2
    assert metrics["refit/bytes"] == 6_000_000 and metrics["refit/bytes_wire"] == 6_000_032
    assert metrics["refit/gbps"] == pytest.approx(6_000_000 / 0.5 / 1e9) and metrics["refit/buckets"] == 3
    assert metrics["refit/pack_s"] == 0.05 and metrics["refit/load_s"] == 0.1 and metrics["refit/onload_s"] == 0.01
    assert metrics["refit/train_ranks"] == 1 and metrics["refit/gen_ranks"] == 2
    # the per-rank detail is the log line (the summary is logged on refit rank 0 only)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "megatron_refit"]
    detail = json.loads(line.removeprefix("refit "))
    assert detail["rank"] == 3 and detail["paths"] == dict(direct=2, packed=0, shared=0)
    assert set(detail["seconds"]) == {"total", "pack", "transfer", "verify", "load", "onload", "offload"}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_refit"):
        Endpoint._emit(SimpleNamespace(on_report=None, group=SimpleNamespace(rank=0)), report)
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_refit"]
    assert json.loads(lines[1].removeprefix("refit summary ")) == metrics
