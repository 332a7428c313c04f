"""The train ranks' side of every engine replica (the fleet), above one rank's endpoints:

- :mod:`.trainer_fleet`: ``TrainerFleet``, every replica's refit at once, membership, the one
  failure policy; :mod:`.replica`: one replica's part of a refit and its outcome;
- :mod:`.member`: a replica's refit group as one rank holds it (``TrainerMember`` on a train
  rank, ``EngineMember`` on an engine rank: the endpoint for all pieces and, under LoRA adapter
  sync, the one for the adapters);
- :mod:`.store`: every key train ranks and replicas share in the train ranks' store (joins,
  leaves, the starting engines' refusal);
- :mod:`.lanes`: train rank 0's control calls to each replica's engine, a lane per replica;
- :mod:`.overlap`: refits sent from a snapshot while the next step trains;
- :mod:`.serving`: proof of serving (``refit.verify_serving``).
"""
