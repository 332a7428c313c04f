"""One wide expert-parallel vLLM deployment driven as one replica: :class:`DeploymentClient`.

A MoE model served at ``--data-parallel-size D`` is one replica of the refit (its experts span
all ``D * T`` ranks: ``refit.gen_attention_dp: D``), and every one of its workers must take each
weight-transfer call: they join one refit group and receive one refit together. vLLM 0.33's own
server does not fan the calls out: ``AsyncLLM.collective_rpc`` reaches the first data-parallel
engine only (``AsyncMPClient.collective_rpc_async`` calls ``call_utility_async`` on
``core_engine``; ``DPAsyncMPClient`` does not override it), so the other DP ranks' workers would
never join. Serve the deployment with one API server per DP rank (vLLM's external load
balancing: ``vllm serve ... --data-parallel-size D --data-parallel-rank r``) and give their
clients to :class:`DeploymentClient`, which calls all of them **at once** (one after another the
first call would wait for workers that are not called yet) and returns once every one returned.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from megatron_refit.fleet.serving import PathScores


class DeploymentClient:
    """The ``VLLMWeightSyncClient`` of one deployment over its DP ranks' clients (``clients[r]``:
    DP rank ``r``'s server, each an ``HTTPClient`` or ``LLMClient``): every call goes to all of them
    in threads of its own (named; started by the first call, joined when the transfer engine shuts
    down); a failure is raised naming its DP rank
    once every call ended. The serving probe is scored through every DP rank (each serves from its own
    attention copy): :class:`~megatron_refit.fleet.serving.PathScores`, judged path by path."""

    def __init__(self, clients: list) -> None:
        if len(clients) < 2:
            raise ValueError(f"DeploymentClient takes one client per DP rank of the deployment, at least 2; got "
                             f"{len(clients)} (one engine without data parallelism is its own client)")
        self.clients = list(clients)
        self._pool: ThreadPoolExecutor | None = None

    def _all(self, method: str, *args) -> list:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="megatron_refit-dp-rank")
        futures = [self._pool.submit(getattr(client, method), *args) for client in self.clients]
        errors = [(rank, future.exception()) for rank, future in enumerate(futures)]  # waits for every one
        errors = [(rank, exc) for rank, exc in errors if exc is not None]
        if errors:
            rank, exc = errors[0]
            raise RuntimeError(f"{method} failed on the deployment's DP rank {rank} ({len(errors)} of "
                               f"{len(self.clients)} failed): {type(exc).__name__}: {exc}") from exc
        return [future.result() for future in futures]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def start_draft_weight_update(self) -> None:
        self._all("start_draft_weight_update")

    def update_weights(self, update_info) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        try:
            self._all("shutdown_weight_transfer_engine")
        finally:
            self.close()

    def score(self, sequences: list[list[int]]) -> PathScores:
        served = self._all("score", sequences)
        return PathScores(tuple((f"DP rank {rank}", answer) for rank, answer in enumerate(served)))

    def hold(self) -> None:
        self._all("hold")

    def speculation(self) -> dict[str, int]:
        """The deployment's speculative decoding so far (each DP rank's server's counters, summed:
        ``HTTPClient.speculation``), its draft and accepted tokens."""
        counts = self._all("speculation")
        return {key: sum(c[key] for c in counts) for key in counts[0]}

    def close(self) -> None:
        """Join this client's threads (every call ended when it returned); a later call starts new ones."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
