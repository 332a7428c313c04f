"""vLLM as an engine: megatron_refit as a vLLM weight-transfer backend (vLLM 0.33's
``distributed/weight_transfer``), each side in its own package.

- :mod:`.trainer` (the trainer's processes; imports without vLLM, as Megatron training
  environments often lack it): ``MegatronRefitTrainerEngine`` and ``LocalShardSource``
  (:mod:`.trainer.engine`), the control-plane clients that pause generation and drop the prefix
  cache around an update, and one over several engines (:mod:`.trainer.clients`).
- :mod:`.worker` (vLLM's worker processes; imports vLLM): ``MegatronRefitEngine``
  (:mod:`.worker.engine`), the payloads' parsing (:mod:`.worker.info`), the fused-MoE reload
  made to run the experts' post-load step (:mod:`.worker.moe_reload`).
- Both: :mod:`.payload` (the ``init_info`` / ``update_info`` payloads and the swap route's body,
  plain JSON) and :mod:`.plugin` (the ``vllm.general_plugins`` entry point that registers both
  by name).
- :mod:`.server_swap` (vLLM's API server process): the ``vllm.endpoint_plugins`` entry point whose
  ``POST /megatron_refit/swap`` makes a staged swap one pause of the engine core between two
  scheduler steps (``HTTPClient(policy="in_flight")``).

The storages they write through are the fused layout vLLM shares with SGLang
(:mod:`megatron_refit.engines.fused`). See docs/guide-engines.md.
"""

BACKEND = "megatron_refit"
"""The name vLLM's factories know this backend by (``WeightTransferConfig(backend=...)``)."""
