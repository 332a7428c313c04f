"""SGLang as an engine, each side in its own package: its custom weight loader in every TP
worker (:mod:`.worker.loader`), the trainer's control clients and their engine control
(:mod:`.trainer`); the control messages both read and write (:mod:`.messages`)."""
