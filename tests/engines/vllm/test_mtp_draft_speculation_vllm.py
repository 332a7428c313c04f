"""#67: ``LLMClient.speculation`` reads an offline ``vllm.LLM``'s speculative-decoding counters as
vLLM 0.33 keeps them: its own ``SpecDecodingProm`` (two engines' label sets) observes its own
``SpecDecodingStats``, and its own ``get_metrics_snapshot`` is what ``LLM.get_metrics`` returns. An
``LLM`` without statistics (``disable_log_stats=True``, the offline default, where vLLM's
``get_metrics`` asserts) is refused by name."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")


def _llm(log_stats: bool):
    from vllm.v1.metrics.reader import get_metrics_snapshot

    engine = types.SimpleNamespace(log_stats=log_stats)
    return types.SimpleNamespace(llm_engine=engine, get_metrics=get_metrics_snapshot)


def test_the_llms_draft_and_accepted_tokens_are_read_summed_over_its_engines():
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    from megatron_refit.engines.vllm.trainer.clients import LLMClient

    client = LLMClient(_llm(True))
    before = client.speculation()  # the process's counters, whatever registered them before this test
    spec = types.SimpleNamespace(num_speculative_tokens=2)
    prom = SpecDecodingProm(spec, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    stats = SpecDecodingStats.new(2)
    for drafted, accepted in ((2, 2), (2, 1), (2, 0)):
        stats.observe_draft(drafted, accepted)
    prom.observe(stats, engine_idx=0)
    other = SpecDecodingStats.new(2)
    other.observe_draft(2, 1)
    prom.observe(other, engine_idx=1)
    after = client.speculation()
    assert {k: after[k] - before[k] for k in after} == {"draft_tokens": 8, "accepted_tokens": 4}


def test_an_llm_without_statistics_is_refused_by_name():
    from megatron_refit.engines.vllm.trainer.clients import LLMClient

    with pytest.raises(RuntimeError, match=r"disable_log_stats=False"):
        LLMClient(_llm(False)).speculation()
