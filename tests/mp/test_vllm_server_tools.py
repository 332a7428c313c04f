"""The running-server tools (``megatron_refit.testing.vllm_server``) without a server: a train
rank waiting for a server that died stops at once, and the launch line is the guide's."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from megatron_refit.testing.vllm_server import launch_args, process_alive, wait_healthy
from megatron_refit.local.launch import free_port


def test_vllm_server_tools_wait_stops_once_the_server_process_ended():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    while subprocess.run(["cat", f"/proc/{dead.pid}/stat"], capture_output=True, text=True).stdout.split(")")[-1] \
            .split()[0] != "Z":  # exited, not reaped: what a train rank sees of a crashed server
        time.sleep(0.05)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"vLLM server process {dead.pid} ended before it answered /health"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", timeout_s=60, alive=process_alive(dead.pid))
    assert time.monotonic() - t0 < 5
    dead.wait()
    with pytest.raises(RuntimeError, match="ended before"):
        process_alive(dead.pid)()


def test_vllm_server_tools_wait_times_out_naming_the_url_while_the_process_lives():
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        url = f"http://127.0.0.1:{free_port()}"
        with pytest.raises(TimeoutError, match=f"the vLLM server at {url} did not answer /health within 1"):
            wait_healthy(url, timeout_s=1, alive=process_alive(live.pid))
    finally:
        live.kill()
        live.wait()


def test_vllm_server_tools_launch_line_selects_the_backend_by_name():
    args = launch_args("/m", 8000, tp=2)
    assert args[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--weight-transfer-config") + 1] == '{"backend": "megatron_refit"}'
