"""vLLM, the engine's worker processes: the ``megatron_refit`` weight-transfer engine
(:mod:`.engine`), its payload parsing (:mod:`.info`) and the fused-MoE reload fix
(:mod:`.moe_reload`). Imports vLLM."""
