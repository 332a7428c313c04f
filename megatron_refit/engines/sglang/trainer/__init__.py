"""SGLang, the trainer's process: the control clients (:mod:`.client`) and the engine control
train rank 0 drives them with (:mod:`.control`). Imports without SGLang."""
