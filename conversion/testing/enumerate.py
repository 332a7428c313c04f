"""``python -m conversion.testing.enumerate``: meta-enumerate train ranks of a preset and layout into
a spec cache file (see :mod:`conversion.derive`). Imports Megatron; about 1 s per rank.

The dry run (:mod:`megatron_refit.tools.dryrun`) runs this in a child process when its cache is
missing or stale, so the dry run's own process never imports Megatron or torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def enumerate_specs(model: str, layout, ranks: list[int], dtype: str = "bfloat16") -> dict:
    """``{rank: [ShardSpec]}`` for ``ranks`` of ``layout``, built on the meta device."""
    import torch

    from conversion.presets import hf_config
    from conversion.testing.meta import rank_shard_specs

    config = hf_config(model)
    return {rank: rank_shard_specs(config, layout, rank, dtype=getattr(torch, dtype)) for rank in ranks}


def main(argv=None) -> int:
    from conversion.derive import representative_ranks, save_specs
    from megatron_refit.plan.layout import TrainLayout

    p = argparse.ArgumentParser(prog="python -m conversion.testing.enumerate", description=__doc__)
    p.add_argument("--model", required=True, help="preset of conversion.presets.PRESETS")
    p.add_argument("--layout", required=True, help="TrainLayout fields as JSON")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--key", required=True, help="cache key written into the file")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    layout = TrainLayout(**json.loads(args.layout))
    start = time.perf_counter()
    ranks = representative_ranks(layout)
    specs = enumerate_specs(args.model, layout, ranks, args.dtype)
    save_specs(args.out, args.key, specs)
    print(f"enumerated {len(ranks)} representative ranks of {layout.describe()} in "
          f"{time.perf_counter() - start:.1f} s -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
