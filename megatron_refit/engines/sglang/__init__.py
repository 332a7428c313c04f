"""SGLang as an engine: its custom weight loader in every TP worker (``loader``) and the
trainer's control clients (``client``)."""
