"""A client of an HF engine rank while refits land (``RunSpec.traffic``): one forward pass each
time a version goes live, asked at once from a thread of its own, as traffic that keeps coming
would. It records what each pass was answered with: the version of the weights that computed it,
or ``"refused"`` (``StaleWeightsError``: a replica held after a failed serving check). A version
scored before it takes traffic (``refit.verify_serving``) answers no pass before its verdict: one
that fails is never served."""

from __future__ import annotations

import queue
import threading

import torch

from megatron_refit.errors import StaleWeightsError


class Traffic:
    """Passes over ``storage`` (an :class:`~megatron_refit.engines.hf.storage.HFStorage`) with ``tokens``."""

    def __init__(self, storage, tokens: torch.Tensor, *, timeout_s: float = 60.0):
        self.storage, self.tokens, self.timeout_s = storage, tokens, timeout_s
        self._asked: queue.Queue = queue.Queue()
        self._answers: list = []
        set_state = storage.set_state

        def told(state: str, version: int | None) -> None:
            set_state(state, version)
            if state == "ready":  # the version is live: a pass asks for it now
                self._asked.put(version)

        storage.set_state = told
        self._thread = threading.Thread(target=self._run, name="harness-traffic", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._asked.get() is not None:
            try:
                answered = self.storage.step(self.tokens)[1]
            except StaleWeightsError:
                answered = "refused"
            self._answers.append(answered)
            self._asked.task_done()
        self._asked.task_done()

    def take(self) -> list:
        """The answers since the last call, once every pass asked for has one (each waits at most
        for its version's verdict)."""
        done = threading.Thread(target=self._asked.join, daemon=True)
        done.start()
        done.join(self.timeout_s)
        if done.is_alive():
            raise TimeoutError(f"a traffic pass got no answer within {self.timeout_s:g} s")
        answers, self._answers = self._answers, []
        return answers

    def close(self) -> None:
        self._asked.put(None)
        self._thread.join(self.timeout_s)
