"""One rank's side of a refit: ``Refitter`` (train) and ``Receiver`` (engine) over a transport,
the storage protocol an engine implements, bucket bytes, integrity digests, delta refits,
the finite check, reports, FP8 quantization, the LoRA merge and parameter offload."""
