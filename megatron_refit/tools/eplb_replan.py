"""An EPLB move re-planned, timed in a process of its own (#65): what a rank of one wide
expert-parallel deployment's refit group does when the deployment rejoins with its experts moved.

The dry run of a config with ``gen_eplb: true`` plans one deployment (the run-time refit group)
at its first map and at a moved one (:func:`moved`: every layer's map permuted, so nearly every
slot holds another expert, as vLLM's own rebalance does: ``scripts/eplb_moves.py``), writes both
gathers (:func:`~megatron_refit.tools.prepare_rank.write_gathered`) and runs
``python -m megatron_refit.tools.eplb_replan BEFORE AFTER --side gen --rank 0`` per timed rank.
The child builds the rank's plan from BEFORE untimed, then times what its ``prepare()`` does at
the move: decode the engine ranks' new parts (the train ranks' are known by digest),
:meth:`~megatron_refit.plan.refit_plan.RefitPlan.replanned`, the fingerprints and the agreement.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import tempfile
import time

from megatron_refit import wire
from megatron_refit.plan.agreement import agreement, in_agreement
from megatron_refit.plan.checks import gc_paused
from megatron_refit.plan.expert_placement import ExpertPlacement
from megatron_refit.plan.folded import fold_parts
from megatron_refit.plan.pieces import pack, pack_targets
from megatron_refit.plan.refit_plan import build_local_plan
from megatron_refit.tools.prepare_rank import read_gathered, run_child, write_gathered


def moved(placement: ExpertPlacement, seed: int = 0) -> ExpertPlacement:
    """``placement`` after a rebalance that moves nearly every slot: each MoE layer's
    physical-to-logical map permuted (every expert keeps its number of replicas)."""
    rng = random.Random(seed)
    rows = []
    for layer in range(len(placement.physical_to_logical) or 1):
        row = list(placement.layer_map(layer))
        rng.shuffle(row)
        rows.append(tuple(row))
    return dataclasses.replace(placement, physical_to_logical=tuple(rows))


def time_eplb(train_specs: dict, gen, targets_of, ranks: list[tuple[str, int]], *, bucket_bytes: int,
              direct_bytes: int | None, optional: frozenset[str], timeout_s: float = 600.0,
              repeat: int = 1) -> list[dict]:
    """Each of ``ranks``' re-plan when one deployment of ``gen`` (a GenLayout with a placement)
    moves its experts; ``targets_of(layout)``: the dry run's engine targets of a layout
    (``repeat``: the median of that many runs, :func:`~megatron_refit.tools.prepare_rank.run_child`)."""
    one = dataclasses.replace(gen, dp=1)
    packed: dict[int, tuple] = {}
    for _, specs in sorted(train_specs.items()):
        if id(specs) not in packed:  # DP replicas share one list of specs: packed once
            packed[id(specs)] = pack(specs)
    train = [packed[id(specs)] for _, specs in sorted(train_specs.items())]
    before = fold_parts(pack_targets(targets_of(one)))  # as the engine ranks gather them
    after = fold_parts(pack_targets(targets_of(dataclasses.replace(one, placement=moved(one.placement)))))
    with tempfile.TemporaryDirectory(prefix="refit-eplb-") as tmp:
        paths = [os.path.join(tmp, name) for name in ("before.bin", "after.bin")]
        for path, gen_parts in zip(paths, (before, after)):
            write_gathered(path, train + [gen_parts[r] for r in range(len(gen_parts))], num_train=len(train),
                           bucket_bytes=bucket_bytes, direct_bytes=direct_bytes, optional=optional)
        return [run_child("megatron_refit.tools.eplb_replan", [*paths, "--side", side, "--rank", str(rank)],
                          f"{side} rank {rank}'s EPLB re-plan", timeout_s, repeat) for side, rank in ranks]


def _gathered(path: str) -> tuple[list, dict, list]:
    blobs, header = read_gathered(path)
    return blobs, header, header["parts"]


def replan_once(before: str, after: str, side: str, rank: int) -> dict:
    """``{"side", "rank", "seconds", "first_seconds", "replanned", "transfers"}``: the rank's plan
    of BEFORE (``first_seconds``: the group's first prepare), then its re-plan for AFTER's engine
    parts, timed (``replanned`` False: a full build was needed)."""
    blobs, header, parts = _gathered(before)
    num_train = header["num_train"]
    kw = dict(bucket_bytes=header["bucket_bytes"], direct_bytes=header["direct_bytes"], local=(side, rank),
              optional=frozenset(header["optional"]))
    first = time.perf_counter()
    with gc_paused():  # the group's first prepare (as prepare_once times it), keeping what a move needs
        decoded = [wire.loads(blob) for blob in blobs]
        plan = build_local_plan([(decoded[n], decoded[lay]) for n, lay in parts], num_train, **kw)
        summary = list(agreement(plan.fingerprints()))
        in_agreement(plan, [summary] * len(parts))  # every rank's, as the control header's rows come back
    first = time.perf_counter() - first
    with gc_paused():
        new_blobs, _, new_parts = _gathered(after)
        known = {hashlib.sha256(blob).digest(): part for blob, part in zip(blobs, decoded)}
        digests = [hashlib.sha256(blob).digest() for blob in new_blobs]  # what the gather hands over with them
        gen_blobs = sorted({i for n, lay in new_parts[num_train:] for i in (n, lay)})
        start = time.perf_counter()
        # what is known by digest (the train ranks' parts, the engine ranks' names) is not decoded again
        fresh = {i: known[digests[i]] if digests[i] in known else wire.loads(new_blobs[i]) for i in gen_blobs}
        gen = {r: (fresh[n], fresh[lay]) for r, (n, lay) in enumerate(new_parts[num_train:])}
        again = plan.replanned(gen)
        if again is None:
            again = build_local_plan([(decoded[n], decoded[lay]) for n, lay in parts[:num_train]]
                                     + list(gen.values()), num_train, **kw)
        summary = agreement(again.fingerprints())  # every rank's, as the control header's rows come back
        in_agreement(again, [list(summary) for _ in new_parts])
        seconds = time.perf_counter() - start
    return {"side": side, "rank": rank, "seconds": seconds, "first_seconds": first, "replanned": again.basis is not None
            and again.basis.holding is not None, "transfers": len(again.transfers)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_refit.tools.eplb_replan", description=__doc__.split("\n")[0])
    p.add_argument("before", help="the gathered parts at the first map, as write_gathered writes them")
    p.add_argument("after", help="the same after the move")
    p.add_argument("--side", choices=("train", "gen"), required=True)
    p.add_argument("--rank", type=int, required=True)
    args = p.parse_args(argv)
    print(json.dumps(replan_once(args.before, args.after, args.side, args.rank)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
