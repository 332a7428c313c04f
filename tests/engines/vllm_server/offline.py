"""The offline ``vllm.LLM`` path, in the server's environment (vLLM 0.32 importable on the
trainer side too): train ranks' saved Megatron pieces (``session.session_tp2``) are sent by
``WeightTransferTrainerFactory.trainer_init`` (after ``load_general_plugins()``: vLLM's own
trainer factory finds our engine by name) through ``LLMClient`` into an ``LLM`` whose
``weight_transfer_config`` selects ``megatron_refit``; its greedy tokens must equal the
Megatron model's. ``verify_serving: on`` against Megatron's recorded forward over the probe
(:class:`Recorded`): every version is scored through ``LLMClient.score`` before it takes traffic
(the client's gate): a ``generate`` asked while a version is under its check waits for the verdict,
runs over a version that passed, and is refused over one that failed (version 8, whose recorded
reference is shifted), until the next version passes. Prints one JSON line.

    python tests/engines/vllm_server/offline.py SAVE_DIR CHECKPOINT
"""

from __future__ import annotations

import json
import os
import sys

import torch

NUM_TRAIN = 2


class Recorded:
    """The trainer's forward over the serving probe as Megatron computed it for the saved version
    (``conversion.serving.trainer_forward``, in ``session.session_tp2``); ``shift`` moves every
    log-prob, as a version the engine does not serve would."""

    experts = routes = None  # a dense model
    dtype = "float32"
    lora = False

    def __init__(self, saved: dict):
        self.vocab_size, self.scale, self._logprobs = saved["vocab_size"], saved["scale"], saved["logprobs"]
        self.probe = [tuple(q) for q in saved["probe"]]
        self.shift = 0.0

    def prepare(self, *, fp8: bool) -> None:
        pass

    def cover(self, base, *, budget: int, seed: int):
        return tuple(base)  # dense: every probe covers its experts

    def __call__(self, sequences):
        if [tuple(q) for q in sequences] != self.probe:
            raise ValueError("the serving check asked another probe than the one Megatron scored")
        return [[v + self.shift for v in row] for row in self._logprobs]


def _asked_on_landing(client, llm, prompt, params) -> dict:
    """A ``generate`` asked the moment the version has landed (``finish_weight_update`` returned),
    from a thread of its own, as an RL loop's rollout worker would: what it got, and how long it
    waited (at the client's gate, until the verdict on the version)."""
    import threading
    import time

    out, landed, finish = {}, threading.Event(), client.finish_weight_update

    def finished(*args, **kwargs):
        finish(*args, **kwargs)
        landed.set()

    def ask():
        landed.wait()
        t0 = time.perf_counter()
        try:
            out["tokens"] = list(llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids)
        except Exception as exc:  # noqa: BLE001 -- the test reads what generate raised
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["waited_s"] = time.perf_counter() - t0

    client.finish_weight_update = finished
    thread = threading.Thread(target=ask, name="rollout", daemon=True)
    thread.start()
    return dict(out=out, thread=thread, undo=lambda: setattr(client, "finish_weight_update", finish))


def _rank(rank: int, world: int, port: int, save_dir: str, checkpoint: str, refit_port: int):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.engines.vllm.trainer.clients import LLMClient
    from megatron_refit.engines.vllm.trainer.engine import LocalShardSource, MegatronRefitTrainerInitInfo
    from megatron_refit.errors import ReplicaFailedError

    load_general_plugins()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    saved = torch.load(os.path.join(save_dir, f"rank{rank}.pt"), weights_only=False)
    forward = Recorded(saved)
    source = LocalShardSource([TensorPiece(spec, tensor) for spec, tensor in saved["weights"]], forward=forward)
    llm = client = params = None
    if rank == 0:
        from vllm import LLM, SamplingParams
        from vllm.config.weight_transfer import WeightTransferConfig

        llm = LLM(model=checkpoint, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4,
                  skip_tokenizer_init=True, weight_transfer_config=WeightTransferConfig(backend="megatron_refit"))
        client = LLMClient(llm)
        params = SamplingParams(temperature=0.0, max_tokens=len(saved["megatron"]), ignore_eos=True)
    torch.distributed.barrier()
    info = MegatronRefitTrainerInitInfo(refit=dict(engine="vllm", gen_tp=1, timeout_s=120, port=refit_port,
                                                   verify_serving="on"), num_train=world, rank=rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    out = dict(engine=type(engine).__name__, metadata=len(source.metadata()), megatron=saved["megatron"])
    for version, shift in ((7, 0.0), (8, 0.5), (9, 0.0)):  # 8: the engine does not serve the reference
        forward.shift = shift
        asked = _asked_on_landing(client, llm, saved["prompt"], params) if rank == 0 else None
        try:
            report = engine.send_weights(version)
        except ReplicaFailedError as exc:  # the one replica failed (version 8): no replica holds it
            report = exc.report
        if rank == 0:
            asked["thread"].join(60)
            asked["undo"]()
            out[f"v{version}"] = dict(asked["out"], failed=report.failed_replicas,
                                      dlogprob=report.summary["refit/serving_max_dlogprob"],
                                      checked=report.summary["refit/serving_checked"])
    if rank == 0:
        out["tokens"] = out["v7"].get("tokens")
        out["max_dlogprob"] = out["v7"]["dlogprob"]  # LLMClient.score: LLM.generate's prompt_logprobs
    engine.shutdown()
    return out


def main() -> int:
    import multiprocessing as mp

    from megatron_refit.local.launch import free_ports

    save_dir, checkpoint = sys.argv[1:3]
    port, refit_port = free_ports(2)
    args = (NUM_TRAIN, port, save_dir, checkpoint, refit_port)
    # vLLM and the trainer side imported once, then rank 1 forked (still one thread: a fresh
    # interpreter would import vLLM again, about 20 CPU-s on 2 cores)
    import vllm.distributed.weight_transfer.factory  # noqa: F401
    import vllm.plugins  # noqa: F401

    import megatron_refit.engines.vllm.trainer.engine  # noqa: F401
    other = mp.get_context("fork").Process(target=_rank, args=(1, *args))  # rank 0 holds the LLM here:
    other.start()  # vLLM starts processes of its own, which a daemonic rank could not
    try:
        out = _rank(0, *args)
    finally:
        other.join(timeout=120)
    print(json.dumps(dict(out, other_exit=other.exitcode)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
