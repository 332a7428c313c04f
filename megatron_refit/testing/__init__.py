"""Test support, as ``torch.testing`` is torch's: in-memory storages (``storages``), toy engines,
fleets and groups (``toy_*``), a running vLLM server (``vllm_server``), the serving check's
power harness (``serving_power``), the warm forkserver's preloads (``preload*``). Tests and
benchmarks use it; the runtime, the tools and the demo never import it (the demo's end-to-end
run is :mod:`megatron_refit.local`)."""
