"""vLLM as an engine: its storage and megatron_refit as a vLLM weight-transfer backend (vLLM
0.33's ``distributed/weight_transfer``).

- :mod:`.layout`: vLLM's fused layout (``qkv_proj``, ``gate_up_proj``, FusedMoE ``w13`` /
  ``w2``, padded vocabulary), which SGLang's models share; :mod:`.live`: ``EngineReceiver``
  over a live model's own parameters and vLLM's post-load step.
- :mod:`.plugin`: the ``vllm.general_plugins`` entry point that registers the backend name.
- :mod:`.worker`: ``MegatronRefitEngine``, the engine in every vLLM worker.
- :mod:`.trainer`: ``MegatronRefitTrainerEngine`` and ``LocalShardSource`` on train ranks.
- :mod:`.payload`: the ``init_info`` / ``update_info`` payloads (plain JSON); :mod:`.info`
  their engine-side parsing.
- :mod:`.clients`: control-plane clients that pause generation and drop the prefix cache
  around an update (``LLMClient``, ``HTTPClient``), and one over several engines.

:mod:`.worker` and :mod:`.info` import vLLM (they run in its workers); the trainer side
(:mod:`.trainer`, :mod:`.clients`, :mod:`.payload`) imports without it, as Megatron training
environments often lack it. See docs/guide-engines.md.
"""

BACKEND = "megatron_refit"
"""The name vLLM's factories know this backend by (``WeightTransferConfig(backend=...)``)."""
