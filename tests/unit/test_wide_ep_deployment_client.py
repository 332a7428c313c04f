"""The client of one wide expert-parallel vLLM deployment (#64): every weight-transfer call reaches every DP
rank's server **at once** (the DP ranks' workers form one refit group: called one after another, the first
would wait for the rest), a failure is raised naming its DP rank after every call ended, its threads are
named and joined when the transfer engine shuts down; the probe is scored through every DP rank. The real
vLLM workers driven through it: tests/engines/vllm/test_wide_ep_weight_transfer.py."""

from __future__ import annotations

import threading

import pytest

from megatron_refit.engines.vllm.trainer.deployment_client import DeploymentClient


class _Server:
    """A DP rank's client whose update waits, bounded, for every DP rank's update to have begun."""

    def __init__(self, barrier: threading.Barrier, rank: int, fail: str | None = None):
        self.barrier, self.rank, self.fail, self.calls, self.threads = barrier, rank, fail, [], []

    def _call(self, name, *args):
        self.calls.append((name, args))
        self.threads.append(threading.current_thread().name)
        if name == self.fail:
            raise RuntimeError(f"engine error on DP rank {self.rank}")

    def init_weight_transfer_engine(self, info):
        self._call("init", info)

    def start_weight_update(self):
        self._call("start")

    def update_weights(self, info):
        self.barrier.wait(timeout=10)  # a collective: every DP rank's update must run at once
        self._call("update", info)

    def finish_weight_update(self, version=None):
        self._call("finish", version)

    def shutdown_weight_transfer_engine(self):
        self._call("shutdown")

    def score(self, sequences):
        self._call("score")
        return [[float(self.rank)] * len(s) for s in sequences]

    def hold(self):
        self._call("hold")

    def speculation(self):
        self._call("speculation")
        return {"draft_tokens": 10 * (self.rank + 1), "accepted_tokens": self.rank + 3}


def test_every_call_reaches_every_dp_rank_at_once():
    barrier = threading.Barrier(3)
    servers = [_Server(barrier, r) for r in range(3)]
    client = DeploymentClient(servers)
    client.init_weight_transfer_engine({"replica": 1})
    client.start_weight_update()
    client.update_weights({"version": 4})  # would time out at the barrier if called one after another
    client.finish_weight_update("4")
    assert client.score([[1, 2]]).paths == (("DP rank 0", [[0.0, 0.0]]), ("DP rank 1", [[1.0, 1.0]]),
                                            ("DP rank 2", [[2.0, 2.0]]))  # through every DP rank
    client.shutdown_weight_transfer_engine()
    for server in servers:
        names = [name for name, _ in server.calls]
        assert names == ["init", "start", "update", "finish", "score", "shutdown"]
        assert server.calls[0] == ("init", ({"replica": 1},))
        assert all(t.startswith("megatron_refit-dp-rank") for t in server.threads), server.threads
    assert not any(t.name.startswith("megatron_refit-dp-rank") for t in threading.enumerate())  # joined


def test_a_failing_dp_rank_is_named_after_every_call_ended():
    barrier = threading.Barrier(2)
    servers = [_Server(barrier, 0), _Server(barrier, 1, fail="update")]
    client = DeploymentClient(servers)
    with pytest.raises(RuntimeError, match=r"update_weights failed on the deployment's DP rank 1 \(1 of 2 failed\): "
                                           r"RuntimeError: engine error on DP rank 1"):
        client.update_weights({"version": 1})
    assert [name for name, _ in servers[0].calls] == ["update"]  # DP rank 0's call ran to its end
    client.close()


def test_the_deployments_draft_acceptance_sums_its_dp_ranks_servers():
    """#67: each DP rank's server counts the drafts it served; the deployment's are their sum."""
    servers = [_Server(threading.Barrier(1), r) for r in range(3)]
    client = DeploymentClient(servers)
    assert client.speculation() == {"draft_tokens": 60, "accepted_tokens": 12}
    assert all([name for name, _ in server.calls] == ["speculation"] for server in servers)
    client.close()


def test_one_client_is_not_a_deployment():
    with pytest.raises(ValueError, match=r"one client per DP rank of the deployment, at least 2; got 1"):
        DeploymentClient([object()])
