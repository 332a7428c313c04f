"""The train ranks' side of every engine replica (the fleet), above one rank's endpoints (the
engine ranks' side is :mod:`megatron_refit.engine_side`; what both hold of a replica's group,
:mod:`megatron_refit.group`):

- :mod:`.trainer_fleet`: ``TrainerFleet``, every replica's refit at once, membership, the one
  failure policy; :mod:`.replica`: one replica's part of a refit and its outcome;
- :mod:`.member`: a replica's refit group as a train rank holds it (``TrainerMember``);
- :mod:`.watchdog`: train rank 0's watch over the replicas' heartbeats;
- :mod:`.lanes`: train rank 0's control calls to each replica's engine, a lane per replica;
- :mod:`.overlap`: refits sent from a snapshot while the next step trains;
- :mod:`.serving`: proof of serving (``refit.verify_serving``).
"""
