"""Progress bars are silent off a terminal; a refit's metrics carry what a loop logs."""

from __future__ import annotations

import io
import json
import logging
from types import SimpleNamespace

import pytest

from megatron_refit.progress import Bar, on_terminal
from megatron_refit.report import RefitReport


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
        bar.on_report(RefitReport(version=1, role="train", rank=0, bytes_sent=2_000_000_000,
                                  seconds=dict(total=2.0)).as_dict())
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
    from megatron_refit.endpoint import Endpoint

    report = RefitReport(version=7, role="gen", rank=3, bytes_received=3_000_000, bytes_wire=3_000_016,
                         bytes_minimal=6_000_000)
    report.seconds.update(total=0.5, transfer=0.4, load=0.1)
    report.routes["direct"] = 2
    seen = []
    with caplog.at_level(logging.INFO, logger="megatron_refit"):
        Endpoint._emit(SimpleNamespace(on_report=seen.append), report)
    metrics = seen[0]
    assert metrics["version"] == 7 and metrics["routes"] == dict(direct=2, packed=0, shared=0)
    assert metrics["bytes_received"] == 3_000_000 and metrics["bytes_minimal"] == 6_000_000
    assert metrics["gbps"] == pytest.approx(3_000_000 / 0.5 / 1e9)
    assert set(metrics["seconds"]) == {"total", "pack", "transfer", "verify", "load", "onload", "offload"}
    (line,) = [r.getMessage() for r in caplog.records if r.name == "megatron_refit"]
    assert line.startswith("refit ") and json.loads(line.removeprefix("refit ")) == metrics
