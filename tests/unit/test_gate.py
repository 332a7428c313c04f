"""A version scored before it takes traffic (refit.verify_serving, #50 item 4): an engine's
gate keeps traffic's forward passes off a version under its serving check until the verdict;
the probe's own scoring passes; a failed verdict refuses them (no answer from the failed
version), a passed one lets them go on over the version. Threads only, no process."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_refit.endpoint.storage import GatesTraffic, WeightsState
from megatron_refit.engines.vllm.trainer.clients import LLMClient
from megatron_refit.errors import StaleWeightsError
from megatron_refit.config import RefitConfig
from megatron_refit.engines.vllm.trainer.control import VllmControl


class _Engine(WeightsState):
    """An engine's two ways into its weights, as HFStorage has them: traffic's pass (waits at
    the gate) and the probe's scoring (does not)."""

    def step(self):
        with self.serving:
            self.wait_gate()
            self.require_ready("engine")
            return self.weights_version

    def score(self):
        with self.serving:
            self.require_ready("engine")
            return self.weights_version


def _ask(engine: _Engine) -> tuple[threading.Thread, list]:
    answers: list = []

    def ask():
        try:
            answers.append(engine.step())
        except StaleWeightsError as exc:
            answers.append(str(exc))

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread, answers


def test_traffic_waits_for_the_verdict_on_a_gated_version_and_the_probe_does_not():
    engine = _Engine()
    assert isinstance(engine, GatesTraffic)
    engine.set_state("ready", 1)
    engine.gate(2)
    assert engine.step() == 1  # the version before the gated one serves on (a staged swap)
    engine.set_state("ready", 2)
    thread, answers = _ask(engine)
    time.sleep(0.2)
    assert answers == [] and thread.is_alive()  # waiting at the gate
    assert engine.score() == 2  # the probe scores the gated version meanwhile
    engine.release()
    thread.join(5)
    assert answers == [2] and engine.last_gate_s >= 0.2
    assert engine.step() == 2  # open


def test_a_failed_verdict_refuses_the_waiting_traffic_no_pass_reads_the_failed_version():
    engine = _Engine()
    engine.gate(3)
    engine.set_state("ready", 3)
    thread, answers = _ask(engine)
    time.sleep(0.1)
    engine.hold("replica 0 does not serve the trainer's model")
    engine.release()
    thread.join(5)
    assert len(answers) == 1 and "the weights of refit 3 failed their serving check" in answers[0], answers
    engine.set_state("ready", 4)  # the next refit lands: served again
    assert engine.step() == 4


def test_a_refit_that_fails_after_the_gate_leaves_no_pass_waiting():
    engine = _Engine()
    engine.set_state("ready", 1)
    engine.gate(2)
    engine.set_state("updating", 1)
    engine.set_state("stale", 1)  # the refit failed: version 2 never went live
    with pytest.raises(StaleWeightsError):
        engine.step()
    engine.release()


class _LLM:
    """vLLM's ``LLM`` as LLMClient drives it (its generate is the class's)."""

    def generate(self, *args, **kwargs):
        return "generated"

    def finish_weight_update(self, version):
        self.finished = version

    def reset_prefix_cache(self):
        pass


def _generate(llm) -> tuple[threading.Thread, list]:
    answers: list = []

    def call():
        try:
            answers.append(llm.generate(["prompt"]))
        except StaleWeightsError as exc:
            answers.append(str(exc))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, answers


@pytest.mark.parametrize("passed", [True, False])
def test_llm_client_gate_holds_generate_until_the_verdict(passed):
    client = LLMClient(_LLM())
    client.gate(timeout_s=30)
    client.finish_weight_update("7")  # landing does not open the gate
    thread, answers = _generate(client.llm)
    time.sleep(0.2)
    assert answers == [] and thread.is_alive()
    if passed:
        client.release()
    else:
        client.hold()
    thread.join(5)
    if passed:
        assert answers == ["generated"] and client.llm.generate(["p"]) == "generated"
    else:
        assert "the weights of version 7 failed their serving check" in answers[0], answers
        client.finish_weight_update("8")  # the next version lands (unchecked): served again
        assert client.llm.generate(["p"]) == "generated"


def test_llm_client_gate_without_a_verdict_refuses_after_its_timeout_and_ends_at_the_next_landing():
    client = LLMClient(_LLM())
    client.gate(timeout_s=0.1)
    client.finish_weight_update("3")
    with pytest.raises(StaleWeightsError, match="got no verdict within 0.1 s"):
        client.llm.generate(["prompt"])
    client.finish_weight_update("4")  # lands unchecked: the gate left without a verdict ends
    assert client.llm.generate(["prompt"]) == "generated"


class _Client:
    def __init__(self, gates: bool):
        self.calls = []
        if gates:
            self.gate = lambda timeout_s: self.calls.append(("gate", timeout_s))
            self.release = lambda: self.calls.append("release")

    def finish_weight_update(self, version):
        self.calls.append(("finish", version))

    def hold(self):
        self.calls.append("hold")


def _lanes(*clients) -> VllmControl:
    return VllmControl(list(clients), RefitConfig(engine="vllm", gen_dp=len(clients), timeout_s=5.0))


def test_lanes_gate_a_checked_version_before_it_lands_and_end_the_gate_with_the_verdict():
    gated, plain = _Client(gates=True), _Client(gates=False)
    lanes = _lanes(gated, plain)
    for replica in (0, 1):
        lanes.land(replica, 5, gate=True)
    lanes.release(0, passed=True)
    lanes.release(1, passed=True)  # a client without a gate: nothing to end
    assert gated.calls == [("gate", 15.0), ("finish", "5"), "release"]
    assert plain.calls == [("finish", "5")]
    lanes.land(0, 6, gate=True)
    lanes.release(0, passed=False)  # failed: held
    lanes.land(0, 7, gate=True)
    lanes.hold(0)  # a mismatch holds it: the gate ends with the hold
    lanes.release(0, passed=False)
    lanes.land(0, 8)  # unchecked: no gate
    assert gated.calls[3:] == [("gate", 15.0), ("finish", "6"), "hold", ("gate", 15.0), ("finish", "7"), "hold",
                               ("finish", "8")]
    assert lanes.close(tell=False, wait_s=5) == []
