"""The offline ``vllm.LLM`` path, in the server's environment (vLLM 0.32 importable on the
trainer side too): train ranks' saved Megatron pieces (``session.session_tp2``) are sent by
``WeightTransferTrainerFactory.trainer_init`` (after ``load_general_plugins()``: vLLM's own
trainer factory finds our engine by name) through ``LLMClient`` into an ``LLM`` whose
``weight_transfer_config`` selects ``megatron_refit``; its greedy tokens must equal the
Megatron model's, and its log-probs on the serving probe (``LLMClient.score``) Megatron's.
Prints one JSON line.

    python tests/engines/vllm_server/offline.py SAVE_DIR CHECKPOINT
"""

from __future__ import annotations

import json
import os
import sys

import torch

NUM_TRAIN = 2


def _rank(rank: int, world: int, port: int, save_dir: str, checkpoint: str, refit_port: int):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.engines.vllm.trainer.clients import LLMClient
    from megatron_refit.engines.vllm.trainer.engine import LocalShardSource, MegatronRefitTrainerInitInfo

    load_general_plugins()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    saved = torch.load(os.path.join(save_dir, f"rank{rank}.pt"), weights_only=False)
    source = LocalShardSource([TensorPiece(spec, tensor) for spec, tensor in saved["weights"]])
    llm = client = None
    if rank == 0:
        from vllm import LLM, SamplingParams
        from vllm.config.weight_transfer import WeightTransferConfig

        llm = LLM(model=checkpoint, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4,
                  skip_tokenizer_init=True, weight_transfer_config=WeightTransferConfig(backend="megatron_refit"))
        client = LLMClient(llm)
    torch.distributed.barrier()
    info = MegatronRefitTrainerInitInfo(refit=dict(engine="vllm", gen_tp=1, timeout_s=120, port=refit_port),
                                        num_train=world, rank=rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    engine.send_weights(7)
    out = dict(engine=type(engine).__name__, metadata=len(source.metadata()), megatron=saved["megatron"])
    if rank == 0:
        generated = llm.generate([{"prompt_token_ids": saved["prompt"]}],
                                 SamplingParams(temperature=0.0, max_tokens=len(saved["megatron"]), ignore_eos=True))
        out["tokens"] = list(generated[0].outputs[0].token_ids)
        served = client.score(saved["probe"])  # the serving probe through LLM.generate's prompt_logprobs
        out["max_dlogprob"] = max(abs(a - b) for got, want in zip(served, saved["logprobs"], strict=True)
                                  for a, b in zip(got, want, strict=True))
        client.hold()  # what the fleet does to a replica that failed its serving check
        try:
            llm.generate([{"prompt_token_ids": saved["prompt"]}], SamplingParams(max_tokens=1))
            out["held"] = None
        except Exception as exc:  # noqa: BLE001 -- the test reads what generate raised
            out["held"] = f"{type(exc).__name__}: {exc}"
        out["scored_while_held"] = client.score(saved["probe"]) == served  # the check itself goes on
    engine.send_weights(8)  # the next version lands: served again
    if rank == 0:
        generated = llm.generate([{"prompt_token_ids": saved["prompt"]}],
                                 SamplingParams(temperature=0.0, max_tokens=len(saved["megatron"]), ignore_eos=True))
        out["tokens_after_hold"] = list(generated[0].outputs[0].token_ids)
    engine.shutdown()
    return out


def main() -> int:
    import multiprocessing as mp

    from megatron_refit.testing.launch import free_ports

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
