"""An engine rank's side of its replica's refit group, what runs inside the engine's process: its
entry point (:mod:`.entry`: ``engine_refit``), its end of the group (:mod:`.member`:
``EngineMember``) and its heartbeat (:mod:`.heartbeat`). It imports nothing of the train ranks'
side (:mod:`megatron_refit.fleet`, :mod:`megatron_refit.refit`): ``tests/megatron/test_structure.py``.
"""
