"""``python -m megatron_refit.demo``: local-shard enumeration on a tiny model (placeholder
until the end-to-end refit lands: prints every rank's HF-named pieces)."""

from __future__ import annotations

import argparse


def _rank(rank, world_size, port, model, tp, pp, ep):
    from conversion.build import build_model, init_gloo, init_model_parallel
    from conversion.hf_configs import hf_config
    from conversion.local_shards import enumerate_local_shards
    from megatron_refit.layout import TrainLayout

    init_gloo(rank, world_size, port)
    layout = TrainLayout(tp=tp, pp=pp, ep=ep, dp=world_size // (tp * pp))
    init_model_parallel(layout)
    cfg = hf_config(model)
    built = build_model(cfg, layout)
    return [s.spec for s in enumerate_local_shards(built.bridge, built.model, cfg)]


def main(argv=None) -> int:
    from megatron_refit.launch import run_spawned

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="qwen3-moe", choices=["qwen3", "qwen3-moe"])
    p.add_argument("--train-tp", type=int, default=2)
    p.add_argument("--train-pp", type=int, default=1)
    p.add_argument("--train-ep", type=int, default=2)
    args = p.parse_args(argv)
    world = args.train_tp * args.train_pp * max(1, args.train_ep // args.train_tp)
    specs = run_spawned(_rank, world, args.model, args.train_tp, args.train_pp, args.train_ep)
    for rank, rank_specs in enumerate(specs):
        print(f"== train rank {rank}: {len(rank_specs)} pieces")
        for s in rank_specs:
            print(f"  {s.name:55s} global {str(s.global_shape):12s} box {s.box}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
