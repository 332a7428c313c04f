"""What a harness run did, checked: every refit of :func:`~megatron_refit.local.harness.run` against
Bridge's export (bit for bit) and the trainer's logits, summarised in the demo's JSON shape."""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_refit.endpoint.fp8 import fp8_checkpoint
from megatron_refit.engines.hf.checkpoint import model_shape
from megatron_refit.local.harness import RunSpec, hf_config_for, make_gen_backend


def evaluate(spec: RunSpec, results: list[dict]) -> dict:
    """Check every refit of a :func:`run` and summarise it in the demo's JSON shape."""
    from megatron_refit.engines.fused.layout import expected_storage

    train = [r for r in results if r["role"] == "train"]
    gens = [r for r in results if r["role"] == "gen"]
    cfg = hf_config_for(spec)
    shape = model_shape(cfg)
    refits = []
    for i in range(spec.refits):
        t_items = [t["refits"][i] for t in train]
        # a replica one of whose ranks raised holds a partial version on its other ranks: nothing to check
        raised = {g["gen_index"] // spec.gen.deployment_size for g in gens if g["refits"][i]["report"] is None}
        landed = [(g, g["refits"][i]) for g in gens if g["gen_index"] // spec.gen.deployment_size not in raised]
        g_items = [item for _, item in landed]  # a replica that failed this refit holds nothing to check
        bit_exact, logit_diff = None, None
        if spec.collect:
            # MTP layers no engine rank holds are skipped by name (the plan says which)
            skipped = set(train[0]["skipped"])
            export = {n: t for n, t in t_items[0]["export"].items() if n not in skipped}
            if spec.fp8:
                export = fp8_checkpoint(export)
            bit_exact = True
            for g, item in landed:
                if spec.gen.tp == 1 and not spec.wide:
                    want = export
                    got = item["weights"]
                    missing = set(want) - set(got) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
                    bit_exact &= not missing
                else:
                    backend = make_gen_backend(replace(spec, device="cpu"), cfg, g["gen_index"], version=i + 1)
                    want = expected_storage(export, backend.target_specs(), shape, spec.gen.tp, backend.slots)
                    got = item["weights"]
                bit_exact &= set(got) <= set(want) and all(torch.equal(got[n], want[n]) for n in got)
            ref = next((t["logits"] for t in t_items if t["logits"] is not None), None)
            diffs = [float((item["logits"] - ref).abs().max()) for item in g_items if item["logits"] is not None]
            logit_diff = max(diffs) if diffs and ref is not None else None
        reports = [item["report"] for item in t_items + g_items]
        secs = lambda key, items: max(item["report"]["seconds"][key] for item in items)  # noqa: E731
        refits.append(dict(
            version=i + 1,
            bit_exact=bit_exact,
            max_logit_diff=logit_diff,
            bytes_sent=sum(item["report"]["bytes_sent"] for item in t_items),
            bytes_minimal=reports[0]["bytes_minimal"],
            bytes_full=sum(item["report"]["bytes_full"] for item in t_items),
            delta=bool(t_items[0]["report"]["delta"]),
            density=t_items[0]["report"]["summary"]["refit/density"],
            seconds=dict(total=max(r["seconds"]["total"] for r in reports), pack=secs("pack", t_items),
                         transfer=max(r["seconds"]["transfer"] for r in reports), load=secs("load", g_items),
                         onload=secs("onload", t_items), offload=secs("offload", t_items)),
            loss=t_items[-1].get("loss"),
            failed_replicas=t_items[0].get("failed_replicas", {}),
            replanned=[item.get("replanned") for item in t_items],
            replans=[item.get("replans") for item in t_items],
            serves={g["gen_index"] // spec.gen.deployment_size: item.get("serves") for g, item in landed},
            pause_s=max((item["pause_s"] for item in g_items if item.get("pause_s") is not None), default=None),
            traffic={g["gen_index"] // spec.gen.deployment_size: item.get("traffic") for g, item in landed
                     if item.get("traffic")},
            gate_s=max((item["gate_s"] or 0.0 for item in g_items if item.get("gate_s") is not None), default=None),
            replicas_ok=t_items[0]["report"]["summary"]["refit/replicas_ok"],
            serving={k.removeprefix("refit/serving_"): v for k, v in t_items[0]["report"]["summary"].items()
                     if k.startswith("refit/serving_")},
            refit_s=t_items[0]["report"]["summary"]["refit/total_s"],
            wall_s=max((item["wall_s"] for item in t_items if "wall_s" in item), default=None),
            bytes_relayed=t_items[0]["report"]["summary"]["refit/bytes_relayed"],
            relay_fallbacks=t_items[0]["report"]["summary"]["refit/relay_fallbacks"],
            skipped_params=t_items[0]["report"]["summary"]["refit/skipped_params"],
        ))
    diffs = [r["max_logit_diff"] for r in refits if r["max_logit_diff"] is not None]
    return dict(
        bit_exact=all(r["bit_exact"] for r in refits) if spec.collect else None,
        max_logit_diff=max(diffs) if diffs else None,
        model=spec.model,
        dtype=spec.dtype,
        delta=spec.delta,
        fanout=spec.fanout,
        lr=spec.lr,
        fp8=spec.fp8 or None,
        train=dict(tp=spec.train.tp, pp=spec.train.pp, ep=spec.train.ep, dp=spec.train.dp),
        gen=dict(tp=spec.gen.tp, dp=spec.gen.dp, attention_dp=spec.gen.attention_dp),
        summary=train[0]["summary"],
        skipped=train[0]["skipped"],
        refits=refits,
        bytes_shared=sum(r.get("bytes_shared", 0) for r in train) if spec.colocated else None,
    )
