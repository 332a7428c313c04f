"""What a dry run prints of its layouts: each model chunk's decoder layers (text and JSON) and the
engine's layout (text and JSON), for :mod:`megatron_refit.tools.dryrun` and the cost model
(``run``: a :class:`~megatron_refit.tools.dryrun.DryRun`, which imports this module)."""

from __future__ import annotations

from megatron_refit.config.deployment import refused_key
from megatron_refit.plan.layout import TrainLayout


def chunk_json(layout: TrainLayout, num_layers: int) -> dict[str, list[int]]:
    """``{"pp<rank>.vp<stage>": [first, last + 1]}``: the decoder layers of every model chunk, as
    Megatron builds them (the JSON summary's ``chunk_layers``)."""
    return {f"pp{rank}.vp{vp}": [r.start, r.stop] for (rank, vp), r in sorted(layout.chunk_layers(num_layers).items())}


def chunk_text(chunks: dict[tuple[int, int], range]) -> str:
    """Decoder layers per pipeline rank, its virtual stages' ranges joined (``pp0 0-8,18-26 | …``)."""
    text = []
    for rank in sorted({rank for rank, _ in chunks}):
        parts = [f"{r.start}-{r.stop - 1}" if len(r) else "-" for (p, _), r in sorted(chunks.items()) if p == rank]
        text.append(f"pp{rank} {','.join(parts)}")
    return " | ".join(text)


def mtp_text(stages: dict[tuple[int, int], int]) -> str:
    return "".join(f"; MTP x{n} on pp{rank} vp{vp}" for (rank, vp), n in sorted(stages.items()))


def gen_text(run) -> str:
    """The engine layout: TP x DP replicas, or deployments of D data-parallel ranks x T, their EP
    size, expert placement (after the engine's fallback, which is named) and redundant experts."""
    gen, requested = run.gen, run.refit.gen_expert_placement
    if gen.attention_dp == 1 and gen.placement is None:
        return (f"{run.refit.engine} TP{gen.tp}xDP{gen.dp}{' (expert parallel)' if gen.expert_parallel else ''} "
                f"= {gen.world_size} ranks")
    text = f"deployment {run.deployment.describe(run.refit.engine)}"
    if run.deployment.fallback:
        text += f"; gen_expert_placement {requested} -> {run.deployment.strategy}: {run.deployment.fallback}"
    if not gen.expert_parallel and gen.attention_dp > 1:
        text += f"; routed experts MoE-TP over the deployment's {gen.deployment_size} ranks"
    if run.refit.gen_dense_forward == "node":
        text += (f"; dense rows split over the DP ranks of a node ({run.refit.gen_node_ranks} engine ranks) and "
                 "forwarded there (gen_dense_forward: node): planned as each rank takes its share")
    key = refused_key(run.refit)
    if key is not None:
        text += f"; engine {run.refit.engine} refuses it at a refit: refit.{key}={getattr(run.refit, key)!r}"
    return text


def gen_json(run) -> dict:
    """The engine deployment of the JSON summary (``expert_parallel_size``: vLLM's EP size, 1 without
    expert parallelism; ``placement``: the strategy planned, after the engine's fallback)."""
    gen = run.gen
    return {"engine": run.refit.engine, "tp": gen.tp, "attention_dp": gen.attention_dp, "replicas": gen.dp,
            "world_size": gen.world_size, "expert_parallel_size": gen.deployment_size if gen.expert_parallel else 1,
            "placement": run.deployment.strategy if gen.expert_parallel else None,
            "placement_fallback": run.deployment.fallback,
            "redundant_experts": gen.placement.num_redundant if gen.placement is not None else 0,
            "eplb": run.refit.gen_eplb, "dense_forward": run.refit.gen_dense_forward,
            "node_ranks": run.refit.gen_node_ranks, "refused_key": refused_key(run.refit)}
