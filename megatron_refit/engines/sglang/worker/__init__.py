"""SGLang, the engine's TP workers: megatron_refit as SGLang's custom weight loader
(:mod:`.loader`)."""
