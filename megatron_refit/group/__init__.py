"""One engine replica's refit group as both its sides hold it (the train ranks; the replica's
engine ranks): what each side checks and opens to join it (:mod:`.connect`), the keys both share in
the train ranks' store (:mod:`.store`), the heartbeat's protocol (:mod:`.beats`), the endpoints a
rank holds in it (:mod:`.member`) and the serving probe in band (:mod:`.inband`). The train ranks'
side is :mod:`megatron_refit.fleet`, the engine ranks' :mod:`megatron_refit.engine_side`; neither
imports the other.
"""
