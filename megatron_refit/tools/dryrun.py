"""``python -m megatron_refit.dryrun --config configs/<model>.yaml [--json]``.

Validates a training YAML's ``refit:`` section and the trainer layout in its Bridge
``model:`` section, then builds the full-scale refit plan in one CPU process:

1. *Enumeration* (cached per model + layout + dtype + package versions): the
   representative train ranks (:func:`conversion.derive.representative_ranks`) are
   built on the meta device in a child process (``python -m conversion.testing.enumerate``; it
   imports Megatron, about 1 s per rank) and written to ``<config dir>/cache/``
   (:mod:`megatron_refit.tools.enumeration_cache`).
2. *Plan* (the measured figure): load that cache, derive every train rank's ShardSpecs,
   compute every engine TP rank's targets (:func:`megatron_refit.plan.gen_layout.gen_targets`),
   validate and assign senders (:class:`megatron_refit.plan.assignment.Assignment`: the senders,
   bytes and transfers that ``RefitPlan`` expands into buckets, planned once per family of
   parameters that match box for box). This process imports neither Megatron nor torch.
3. *Prepare* (``prepare_seconds``): what each rank's ``prepare()`` does once the pieces are
   gathered, timed on the train rank that sends the most transfers and the gen rank that
   receives the most: decoding every distinct gathered part from its wire form, then
   :func:`megatron_refit.plan.refit_plan.build_local_plan` (the whole plan validated, that
   rank's transfers and buckets expanded), its route fingerprints, and every rank's agreement
   summary (16 numbers in the control header) checked (:func:`~megatron_refit.plan.agreement.in_agreement`).

``plan_seconds`` covers step 2; ``peak_rss_mb`` the whole life of this process (reading the
YAML included, step 3 too); the enumeration's time is reported apart.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

from conversion.derive import derive_all_ranks, load_specs
from megatron_refit.config import RefitConfig, load_training_yaml, train_layout
from megatron_refit.config.deployment import Deployment, deployment_layout
from megatron_refit.families import is_mtp_param
from megatron_refit.plan.assignment import Assignment
from megatron_refit.plan.checks import ITEMSIZE, gc_paused
from megatron_refit.plan.dense_forward import narrow_targets
from megatron_refit.plan.fanout import fanout_routes, resolve_mode
from megatron_refit.plan.folded import fold_parts
from megatron_refit.plan.fp8_layout import fp8_param_table, fp8_specs, is_quantized
from megatron_refit.plan.gen_layout import GenLayout, ModelShape, gen_targets
from megatron_refit.plan.layout import TrainLayout
from megatron_refit.plan.pieces import pack, pack_targets
from megatron_refit.tools.cli import plain
from megatron_refit.tools.dryrun_layouts import chunk_json, chunk_text, gen_json, gen_text, mtp_text
from megatron_refit.tools.enumeration_cache import cache_key, ensure_cache
from megatron_refit.tools.eplb_replan import time_eplb
from megatron_refit.tools.prepare_rank import peak_rss_mb, time_ranks

@dataclass
class DryRun:
    """A validated config and its plan."""

    config_path: str
    refit: RefitConfig
    preset: dict
    train: TrainLayout
    gen: GenLayout
    senders: Assignment
    num_params: int
    plan_seconds: float
    """Wall seconds of the plan phase (cache load to sender assignment)."""
    plan_cpu_seconds: float
    """CPU seconds of this process in the same phase (steadier on a shared machine)."""
    enumerate_seconds: float
    cache_path: str
    train_local_bytes: list[int] = field(default_factory=list)
    """Bytes of each train rank's local pieces (the most a ``refit.overlap`` snapshot copies)."""
    skipped: tuple[str, ...] = ()
    """The trainer's MTP parameters, which no engine rank holds (skipped by name, as the refit does)."""
    draft: tuple[str, ...] = ()  # refit.gen_draft: the MTP parameters the engine's draft holds (sent)
    skipped_elements: int = 0
    """Their elements."""
    prepare: dict[str, tuple[float, int, float, float]] = field(default_factory=dict)
    """``{"train rank i" / "gen rank j": (prepare seconds, its transfers, peak RSS MB of its process,
    seconds of its prepare when a replica of a layout it planned rejoins)}`` of the ranks timed."""
    fanout: dict | None = None
    """:func:`fanout_bytes`, once computed."""
    deployment: Deployment | None = None
    """The engine deployment planned (``gen`` and how its expert placement was resolved)."""
    held_bytes: int = 0
    """Bytes of one whole copy of what the engine holds (its parameters in the sent dtypes, each
    once): what one replica must receive at least, however many of its ranks hold a byte."""
    eplb: list[dict] | None = None
    """``gen_eplb``: each timed rank's re-plan when one deployment's experts move
    (:mod:`megatron_refit.tools.eplb_replan`)."""

    @property
    def prepare_seconds(self) -> float:
        return max((timed[0] for timed in self.prepare.values()), default=0.0)

    @property
    def prepare_rss_mb(self) -> float:
        """The largest peak RSS of a timed rank's prepare (its own process)."""
        return max((timed[2] for timed in self.prepare.values()), default=0.0)

    @property
    def rejoin_seconds(self) -> float:
        """The slowest timed rank's prepare when a replica of a layout it planned (re)joins."""
        return max((timed[3] for timed in self.prepare.values()), default=0.0)

    def gen_bytes_max(self) -> int:
        return max(self.senders.gen_bytes().values())

    def bytes_total(self) -> int:
        return sum(self.senders.gen_bytes().values())


def load_config(path: str) -> tuple[RefitConfig, dict, TrainLayout]:
    """``(refit config, HF preset fields, train layout)``; ``ValueError`` naming bad input."""
    from conversion.presets import PRESETS  # plain data; imports nothing heavy

    rest, refit = load_training_yaml(path)
    if refit.model is None:
        raise ValueError(f"{path}: refit.model must name a preset of conversion.presets ({sorted(PRESETS)})")
    if refit.model not in PRESETS:
        raise ValueError(f"{path}: refit.model {refit.model!r} is not a preset; choose from {sorted(PRESETS)}")
    preset = PRESETS[refit.model]
    layout = train_layout(rest, refit, num_experts=num_experts(preset),
                          mtp_layers=preset.get("num_nextn_predict_layers") or 0)
    layout.chunk_layers(preset["num_hidden_layers"])
    from types import SimpleNamespace

    from conversion.validate import check_train_layout  # plain arithmetic on the preset's sizes

    check_train_layout(SimpleNamespace(**preset), layout)  # here, not as a traceback of the enumeration
    return refit, preset, layout


def num_experts(preset: dict) -> int:
    return preset.get("num_experts") or preset.get("n_routed_experts") or 0


def build(config_path: str, *, cache_dir: str | None = None, dtype: str = "bfloat16", prepare: bool = True,
          forward: bool = True, repeat: int = 1) -> DryRun:
    """Validate ``config_path`` and build its plan (see the module docstring); ``prepare``:
    also time the slowest ranks' ``prepare()`` (step 3; ``repeat``: each rank's median of that
    many processes); ``forward`` False: plan every DP rank's
    dense shards from the train ranks whatever ``refit.gen_dense_forward`` says (the cost model
    weighs the schemes from that plan)."""
    refit, preset, layout = load_config(config_path)
    deployment = deployment_layout(refit, replicas=refit.gen_dp, num_experts=num_experts(preset),
                                   num_expert_group=preset.get("n_group"))
    gen = deployment.layout
    cache_dir = cache_dir or os.path.join(os.path.dirname(os.path.abspath(config_path)), "cache")
    key = cache_key(refit.model, preset, layout, dtype)
    path = os.path.join(cache_dir, f"{refit.model}-{layout.describe()}-{dtype}.json.gz")
    enumerate_seconds = ensure_cache(path, refit.model, layout, key, dtype)

    start, cpu_start = time.perf_counter(), time.process_time()
    with gc_paused():
        train_specs, targets, params, skipped, targets_of = _targets(path, key, refit, preset, layout, gen, forward)
        senders = Assignment.build(train_specs, targets)
    plan_seconds, plan_cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    refused = sorted(set(senders.unused_train_params) - set(skipped))
    if refused:  # what the refit's prepare() refuses (MTP layers apart)
        raise ValueError(f"the trainer produces {len(refused)} HF parameters that no generation rank holds, e.g. "
                         f"{refused[:5]}")
    eplb = None
    if prepare and refit.gen_eplb:  # one deployment's ranks re-plan its move: gen rank 0, the busiest sender
        ranks = [("gen", 0), ("train", max(range(len(senders.train_bytes)), key=senders.train_bytes.__getitem__))]
        eplb = time_eplb(train_specs, gen, targets_of, ranks, bucket_bytes=refit.bucket_bytes, optional=frozenset(
            skipped), direct_bytes=refit.bucket_bytes if refit.direct_bytes == "auto" else refit.direct_bytes,
            repeat=repeat)
    prepare = time_prepare(train_specs, targets, senders, refit, frozenset(skipped), repeat) if prepare else {}
    sizes: dict[int, int] = {}  # DP replicas share one list of specs
    local = [sizes.setdefault(id(specs), sum(math.prod(s.shape) * ITEMSIZE[s.dtype] for s in specs))
             for _, specs in sorted(train_specs.items())]
    return DryRun(config_path=config_path, refit=refit, preset=preset, train=layout, gen=gen, senders=senders,
                  deployment=deployment, held_bytes=_held_bytes(targets),
                  num_params=sum(math.prod(shape) for shape, _ in params.values()), plan_seconds=plan_seconds,
                  plan_cpu_seconds=plan_cpu_seconds, enumerate_seconds=enumerate_seconds, cache_path=path,
                  train_local_bytes=local, skipped=tuple(skipped), prepare=prepare, eplb=eplb,
                  skipped_elements=sum(math.prod(params[n][0]) for n in skipped if n in params),
                  draft=tuple(n for n in params if refit.gen_draft and is_mtp_param(n, preset["num_hidden_layers"])))


def time_prepare(train_specs: dict, targets, senders: Assignment, refit: RefitConfig,
                 optional: frozenset[str] = frozenset(), repeat: int = 1) -> dict[str, tuple[float, int, float]]:
    """Step 3 of the module docstring, with ``refit``'s buckets on NCCL (``direct_mb: null``:
    one bucket): ``{"train rank i" / "gen rank j": (seconds, transfers, peak RSS MB)}``, each rank
    timed in a process of its own (:mod:`megatron_refit.tools.prepare_rank`). Each distinct part
    (equal objects: DP replicas, an engine's TP ranks' names) is encoded once, as the gather moves it."""
    parts = []
    packed: dict[int, tuple] = {}
    for _, specs in sorted(train_specs.items()):
        if id(specs) not in packed:
            packed[id(specs)] = pack(specs)
        parts.append(packed[id(specs)])
    gen = fold_parts(pack_targets(targets))  # as an engine rank's prepare() gathers them
    parts += [gen[rank] for rank in range(len(gen))]
    sent, received = senders.transfer_counts()
    ranks = [(side, max(range(len(c)), key=c.__getitem__)) for side, c in (("train", sent), ("gen", received))]
    direct = refit.bucket_bytes if refit.direct_bytes == "auto" else refit.direct_bytes
    timed = time_ranks(parts, ranks, num_train=len(train_specs), bucket_bytes=refit.bucket_bytes,
                       direct_bytes=direct, optional=optional, repeat=repeat)
    return {f"{t['side']} rank {t['rank']}": (t["seconds"], t["transfers"], t["peak_rss_mb"], t["rejoin_seconds"])
            for t in timed}


def _targets(path: str, key: str, refit: RefitConfig, preset: dict, layout: TrainLayout, gen: GenLayout,
             forward: bool = True):
    """Every train rank's pieces (derived from the cache), the engine TP ranks' targets,
    ``{HF name: (global shape, dtype)}`` of the trainer's parameters, and its MTP parameters
    (which the engine's main model does not hold: skipped by name, as the refit does), and the
    targets of any engine layout of the model (a function). ``forward``: under
    ``refit.gen_dense_forward: node`` the targets are what each engine rank takes from the train
    ranks (False: every DP rank its dense shards whole, as ``off``)."""
    train_specs = derive_all_ranks(layout, load_specs(path, key), num_experts(preset))
    params = {}
    for rank_specs in {id(specs): specs for specs in train_specs.values()}.values():
        for s in rank_specs:
            params.setdefault(s.name, (s.global_shape, s.dtype))
    skipped = [] if refit.gen_draft else sorted(n for n in params if is_mtp_param(n, preset["num_hidden_layers"]))
    skip = set(skipped)
    held = {name: value for name, value in params.items() if name not in skip}
    model = ModelShape(num_attention_heads=preset["num_attention_heads"],
                       num_kv_heads=preset.get("num_key_value_heads") or preset["num_attention_heads"],
                       vocab_size=preset["vocab_size"], num_experts=num_experts(preset))
    targets = held
    if refit.trainer_quantize_fp8:  # FP8 weights + scale tiles on both sides (the 128 rule checked)
        train_specs = _quantized(train_specs, skip)
        targets = fp8_param_table(held)
        skipped = sorted({s.name for specs in train_specs.values() for s in specs} - set(targets))

    def targets_of(other: GenLayout):
        planned = gen_targets(targets, other, model, style=refit.gen_style)
        if forward and refit.gen_dense_forward == "node" and other.attention_dp > 1 and model.num_experts:
            # what each engine rank takes from the train ranks: its node group's share of the dense rows
            planned = narrow_targets(planned, other.tp, other.attention_dp, refit.gen_node_ranks)
        return planned

    return train_specs, targets_of(gen), params, skipped, targets_of


def _held_bytes(targets) -> int:
    return sum(math.prod(shape) * ITEMSIZE[dtype] for shape, dtype, boxes in targets.params.values()
               if any(box is not None for box in boxes))


def _quantized(train_specs: dict, skip: set[str] | frozenset[str] = frozenset()) -> dict:
    """Train ranks' specs as trainer-side FP8 sends them (DP replicas share one list); the skipped
    (MTP) parameters pass unchanged, as the trainer's optional pieces do."""
    done: dict[int, list] = {}
    for specs in train_specs.values():
        if id(specs) not in done:
            done[id(specs)] = [q for s in specs for q in (
                fp8_specs(s) if s.name not in skip and is_quantized(s.name, s.global_shape) else (s,))]
    return {rank: done[id(specs)] for rank, specs in train_specs.items()}


def fanout_bytes(run: DryRun) -> dict:
    """``refit.fanout`` of the plan: its mode (``auto`` resolved), the bytes the train ranks send
    and those the replicas relay (off: every replica's from the train ranks, none relayed)."""
    if run.fanout is not None:
        return run.fanout
    pairs = run.senders.route_bytes()
    mode = resolve_mode(run.refit.fanout, pairs, tp=run.gen.deployment_size, dp=run.gen.dp,
                        bucket_bytes=run.refit.bucket_bytes)
    if mode == "off" or run.gen.dp < 2:
        run.fanout = {"mode": "off", "bytes_from_trainers": sum(pairs.values()), "bytes_relayed": 0}
    else:
        routes = fanout_routes(pairs, tp=run.gen.deployment_size, dp=run.gen.dp, mode=mode)
        run.fanout = {"mode": mode, "bytes_from_trainers": routes.bytes_from_trainers,
                      "bytes_relayed": routes.bytes_relayed}
    return run.fanout


def summary_lines(run: DryRun) -> list[str]:
    gen_bytes = run.senders.gen_bytes()
    train_bytes = run.senders.train_bytes
    gb = 1e9
    lines = [
        f"config        {run.config_path}",
        f"model         {run.refit.model}: {run.num_params / 1e9:.2f}B parameters",
        f"train         {run.train.describe_keys()} = {run.train.world_size} ranks",
        f"layers        {chunk_text(run.train.chunk_layers(run.preset['num_hidden_layers']))}"
        f"{mtp_text(run.train.mtp_stages())}",
        f"gen           {gen_text(run)}",
        f"transfers     {run.senders.num_transfers:,} (classes of identical gen ranks: "
        f"{len(run.senders.class_ranks)}; parameter groups: {len(run.senders.groups)})",
        f"bytes total   {run.bytes_total():,} ({run.bytes_total() / gb:.1f} GB; "
        f"{run.bytes_total() / (run.gen.dp * run.held_bytes):.2f}x each byte once per replica)",
        f"per gen rank  max {max(gen_bytes.values()) / gb:.2f} GB, min {min(gen_bytes.values()) / gb:.2f} GB",
        f"per train rk  max {max(train_bytes) / gb:.2f} GB, min {min(train_bytes) / gb:.2f} GB",
        f"skipped       {len(run.skipped)} MTP parameters (held by no engine rank: not sent); draft {len(run.draft)}",
        f"enumeration   {run.enumerate_seconds:.1f} s ({'cached' if run.enumerate_seconds == 0 else 'ran'}: "
        f"{run.cache_path})",
        f"plan          {run.plan_seconds:.2f} s wall, {run.plan_cpu_seconds:.2f} s CPU, "
        f"peak RSS {peak_rss_mb():.0f} MB, torch imported: "
        f"{'torch' in sys.modules}",
    ]
    if run.prepare:
        lines.append("prepare       " + "; ".join(f"{who} {seconds:.2f} s, peak RSS {rss:.0f} MB ({count:,} transfers)"
                                                  for who, (seconds, count, rss, _) in run.prepare.items())
                     + f" (one rank's prepare() after the gather, in a process of its own); a replica rejoining "
                     f"{run.rejoin_seconds * 1e3:.1f} ms (its parts and plan found by digest)")
    if run.eplb:
        lines.append("EPLB move     " + "; ".join(f"{t['side']} rank {t['rank']} {t['seconds'] * 1e3:.0f} ms"
                                                  f"{'' if t['replanned'] else ' (a full build)'}" for t in run.eplb)
                     + " (one deployment's experts all moved, re-planned in a process of its own); the "
                     + "deployment group's first prepare "
                     + "; ".join(f"{t['side']} rank {t['rank']} {t['first_seconds']:.2f} s" for t in run.eplb))
    fanout = fanout_bytes(run)
    lines.append(f"fan-out       {fanout['mode']}: the train ranks send {fanout['bytes_from_trainers'] / gb:.2f} GB, "
                 f"the replicas relay {fanout['bytes_relayed'] / gb:.2f} GB (refit.fanout: {run.refit.fanout})")
    if not run.refit.enabled:
        lines.append("note          refit.enabled is false: a training run with this config would not refit")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_refit.dryrun", description=plain(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="training YAML with a refit: section")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    p.add_argument("--cache-dir", default=None, help="enumeration cache (default: <config dir>/cache)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(ITEMSIZE), help="training dtype")
    p.add_argument("--no-prepare", action="store_true", help="plan only: skip timing the slowest ranks' prepare()")
    p.add_argument("--repeat", type=int, default=1,
                   help="time each rank's prepare() in this many processes and report the median (a busy machine)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    model = None
    try:
        run = build(args.config, cache_dir=args.cache_dir, dtype=args.dtype, prepare=not args.no_prepare,
                    repeat=args.repeat)
        model = run.refit.model
    except (ValueError, FileNotFoundError) as e:  # the user's input: name it, report not ok
        print(f"error: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "model": model or "", "plan_seconds": 0.0, "prepare_seconds": 0.0,
                              "peak_rss_mb": peak_rss_mb(),
                              "num_params": 0, "bytes_per_gen_rank_max": 0, "bytes_total": 0, "error": str(e)}))
        return 2
    print("\n".join(summary_lines(run)))
    if args.json:
        print(json.dumps({
            "ok": run.senders.num_transfers > 0,
            "model": model,
            "plan_seconds": round(run.plan_seconds, 3),
            "prepare_seconds": round(run.prepare_seconds, 3),
            "prepare_rank": max(run.prepare, key=lambda who: run.prepare[who][0], default=""),
            "prepare_peak_rss_mb": round(run.prepare_rss_mb, 1),
            "enumerate_seconds": round(run.enumerate_seconds, 2),
            "rejoin_seconds": round(run.rejoin_seconds, 6),  # tens of µs for a small model
            "eplb_replan_seconds": round(max(t["seconds"] for t in run.eplb), 6) if run.eplb else None,
            "eplb_first_prepare_seconds": round(max(t["first_seconds"] for t in run.eplb), 3) if run.eplb else None,
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "num_params": run.num_params,
            "train": run.train.describe_keys(),
            "chunk_layers": chunk_json(run.train, run.preset["num_hidden_layers"]),
            "skipped_params": len(run.skipped),
            "draft_params": len(run.draft),
            "num_params_skipped": run.skipped_elements,
            "bytes_per_gen_rank_max": run.gen_bytes_max(),
            "bytes_total": run.bytes_total(),
            "bytes_held_per_replica": run.held_bytes,
            "gen": gen_json(run),
            "fanout": fanout_bytes(run),
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
