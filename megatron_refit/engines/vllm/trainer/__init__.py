"""vLLM, the trainer's process: the trainer engine of the ``megatron_refit`` backend
(:mod:`.engine`: ``MegatronRefitTrainerEngine``, ``LocalShardSource``) and the control-plane
clients (:mod:`.clients`). Imports without vLLM."""
