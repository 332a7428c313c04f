"""An SGLang worker's engine rank in the refit, from SGLang's parallel state (imports no SGLang).

SGLang 0.5.23 serves a wide expert-parallel deployment as one engine: ``--tp N --enable-dp-attention
--dp D --ep-size N`` (resolved to ``attn_dp_size`` D, ``dp_size`` 1: ``parallel_hook``) runs
attention TP-sharded over ``attn_tp_size = N / D`` ranks, the same on each of the D attention-DP
ranks, and the routed experts over all N ranks (``moe_ep_size`` N). Its ranks are laid out
``tp_rank = attn_dp_rank * attn_tp_size + attn_tp_rank`` (``runtime_context.derive_attention_ranks``),
the refit's flattened deployment rank ``dp_rank * gen_tp + tp_rank``; its EP rank is its ``tp_rank``
(``moe_ep_rank``). The ``refit:`` section names it ``gen_tp: N / D``, ``gen_attention_dp: D``,
``gen_expert_parallel: true``; each SGLang engine is one replica (its index from the trainer).
"""

from __future__ import annotations


def engine_rank(cfg, parallel, *, replica: int, moe: bool) -> int:
    """``replica * replica_size + tp_rank`` for ``cfg`` (the trainer's ``RefitConfig``) and
    ``parallel`` (SGLang's ``get_parallel()``); ``ValueError`` naming the field where they disagree.
    ``moe``: the model has routed experts. A deployment without attention DP keeps its TP rank
    (``replica * gen_tp + tp_rank``)."""
    if cfg.gen_attention_dp == 1:
        if parallel.tp_size != cfg.gen_tp:
            raise ValueError(f"refit.gen_tp={cfg.gen_tp}, but this SGLang engine runs tp_size={parallel.tp_size}")
        if parallel.attn_dp_size != 1:
            raise ValueError(f"refit.gen_attention_dp=1, but this SGLang engine runs DP attention at "
                             f"attn_dp_size={parallel.attn_dp_size} (--dp with --enable-dp-attention): one deployment "
                             f"of tp_size={parallel.tp_size} ranks (set gen_attention_dp to it, gen_tp to "
                             f"attn_tp_size={parallel.attn_tp_size})")
        return replica * cfg.replica_size + parallel.tp_rank
    if not (moe and cfg.gen_expert_parallel):
        raise ValueError(f"refit.gen_attention_dp={cfg.gen_attention_dp} with gen_expert_parallel="
                         f"{cfg.gen_expert_parallel} for a {'MoE' if moe else 'dense'} model: an SGLang DP-attention "
                         "deployment is planned with its routed experts over all its ranks only (a MoE model, "
                         "--ep-size equal to --tp, gen_expert_parallel: true); its dense MLP and MoE tensor "
                         "parallelism span all tp_size ranks, which the refit does not plan")
    wants = (("tp_size", cfg.replica_size, "--tp: gen_tp * gen_attention_dp"),
             ("attn_dp_size", cfg.gen_attention_dp, "--dp with --enable-dp-attention: gen_attention_dp"),
             ("attn_tp_size", cfg.gen_tp, "--tp / --dp: gen_tp"),
             ("attn_cp_size", 1, "attention context parallelism is not planned"),
             ("moe_ep_size", cfg.replica_size, "--ep-size: tp_size"))
    for field, want, why in wants:
        have = getattr(parallel, field)
        if have != want:
            raise ValueError(f"refit.gen_tp={cfg.gen_tp}, gen_attention_dp={cfg.gen_attention_dp}: the refit plans "
                             f"SGLang's {field}={want} ({why}), this SGLang engine runs {field}={have}")
    if not parallel.enable_dp_lm_head:
        raise ValueError(f"refit.gen_attention_dp={cfg.gen_attention_dp}: this SGLang engine shards lm_head over all "
                         f"tp_size={parallel.tp_size} ranks, the refit plans it over the attention TP ranks "
                         f"(gen_tp={cfg.gen_tp}): serve with --enable-dp-lm-head")
    rank = parallel.attn_dp_rank * parallel.attn_tp_size + parallel.attn_tp_rank
    if parallel.tp_rank != rank or parallel.moe_ep_rank != rank:
        raise ValueError(f"this SGLang worker is tp_rank={parallel.tp_rank}, moe_ep_rank={parallel.moe_ep_rank}, at "
                         f"attn_dp_rank={parallel.attn_dp_rank}, attn_tp_rank={parallel.attn_tp_rank}: the refit "
                         f"plans deployment rank {rank} (attn_dp_rank * attn_tp_size + attn_tp_rank) for all three")
    return replica * cfg.replica_size + rank
