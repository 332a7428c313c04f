"""The fused layout vLLM's and SGLang's parallel layers share (``qkv_proj``, ``gate_up_proj``,
FusedMoE ``w13`` / ``w2``, padded vocabulary): :mod:`.layout` (storage allocated in that layout)
and :mod:`.live` (storage over a live engine model's own parameters). Engine process."""
