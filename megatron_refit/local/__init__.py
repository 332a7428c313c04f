"""A refit on this machine, end to end: what ``python -m megatron_refit.demo`` runs, and the
end-to-end tests and benchmarks build on.

Spawned gloo ranks (``launch``, ``ports``), a tiny model built through Megatron-Bridge and
trained, refitted into generation ranks (``harness``: what a :class:`~.run_spec.RunSpec` asks
for), checked bit for bit against Bridge's export and the trainer's logits (``evaluate``), with
faults injected on purpose (``faults``: an engine error while a refit lands, a broken post-load
step), a client's traffic while versions go live (``traffic``), wide expert-parallel
deployments in vLLM-shaped storage (``fused_engine``) and a progress bar (``progress``). It sits
above the runtime and ``conversion.testing`` (the tiny models' builders); the runtime never
imports it, and it imports nothing of :mod:`megatron_refit.testing`."""
