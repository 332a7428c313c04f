"""Test support, as ``torch.testing`` is torch's: spawned gloo ranks (``launch``), the tiny
end-to-end harness and its checks (``harness``, ``evaluate``), faults injected on purpose
(``faults``), in-memory storages (``storages``), a running vLLM server (``vllm_server``). Tests,
benchmarks and the demo use it; the runtime never imports it."""
