"""End-to-end refit on CPU: spawned Megatron train ranks and generation ranks over gloo.

Used by the demo, the end-to-end tests and the benchmark. Train ranks build a tiny model
through Megatron-Bridge and take a real optimizer step (forward, backward, Adam) before
every refit; generation ranks hold a receiver. After each refit the parent checks the
generation weights against Bridge's ``export_hf_weights`` bit for bit and, where a gen
rank holds a whole model, its logits against the Megatron forward.

Train-rank code imports ``conversion`` (Megatron); generation-rank code does not.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import replace

import torch

from megatron_refit.endpoint.storage import WeightsState
from megatron_refit.engines.hf.checkpoint import hf_param_table, model_shape
from megatron_refit.engines.hf.staged import StagedHFStorage
from megatron_refit.engines.hf.storage import HFStorage
from megatron_refit.plan.fp8_layout import fp8_param_table
from megatron_refit.local.fused_engine import Balancer
from megatron_refit.local.run_spec import RunSpec
from megatron_refit.local.traffic import Traffic

SEQ, BATCH = 8, 2


TRAIN_YAML = """
model:
  tensor_model_parallel_size: 1
refit:
  enabled: true
  engine: hf
  port: ${oc.env:TEST_REFIT_PORT}
  bucket_mb: 0.25
  timeout_s: 120
"""
"""A training config as Bridge's ``pretrain()`` reads it (OmegaConf, the refit port from the
environment): the Bridge-callback tests start from it."""


def tokens_for(version: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + version)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def rank_main(rank: int, world_size: int, port: int, spec: RunSpec):
    cfg = hf_config_for(spec)
    if spec.device == "cuda":
        torch.cuda.set_device(0)
    refit_cfg = refit_config(spec, port)
    if rank < spec.num_train:
        out, side = _train_rank(rank, spec, cfg, refit_cfg)
    else:
        out, side = _gen_rank(rank - spec.num_train, spec, cfg, refit_cfg)
    if spec.colocated:  # side: the train rank's fleet, or the engine rank's member
        groups = [m.group for m in side.members.values()] if rank < spec.num_train else [side.group]
        out["bytes_shared"] = sum(group.bytes_shared for group in groups)
    side.close()
    return out


def refit_config(spec: RunSpec, port: int):
    """The ``refit:`` config section this run corresponds to (the harness goes through the
    same integration calls as a training loop)."""
    from megatron_refit.config import RefitConfig

    deployment = dict(engine="hf" if spec.gen.tp == 1 else "vllm")
    if spec.wide:
        from megatron_refit.local.fused_engine import NAME

        placement = spec.gen.placement
        deployment = dict(engine=NAME, gen_attention_dp=spec.gen.attention_dp,
                          gen_expert_placement=placement.strategy if placement else "linear",
                          gen_redundant_experts=placement.num_redundant if placement else 0,
                          gen_eplb=bool(spec.remap or (placement and placement.num_redundant)),
                          **(dict(gen_dense_forward="node", gen_node_ranks=spec.dense_forward)
                             if spec.dense_forward else {}))
    return RefitConfig(enabled=True, mode="colocated" if spec.colocated else "disaggregated",
                       gen_tp=spec.gen.tp, gen_dp=spec.gen.dp,
                       gen_expert_parallel=spec.gen.expert_parallel, host="127.0.0.1", port=port, **deployment,
                       bucket_mb=spec.bucket_bytes / (1 << 20), trainer_quantize_fp8=spec.fp8 == "trainer",
                       timeout_s=spec.timeout_s, delta=spec.delta, swap=spec.swap,
                       on_replica_failure="continue" if spec.failures_expected else "raise",
                       overlap="on" if spec.overlap else "off", verify_serving=spec.verify_serving, fanout=spec.fanout,
                       serving_tolerance=spec.serving_tolerance, gen_draft=spec.draft, verify=spec.verify)


def hf_config_for(spec: RunSpec):
    # transformers configs are importable on both sides; conversion.presets is not Megatron.
    from conversion.presets import hf_config

    return hf_config(spec.model, **spec.overrides)


def check_layout(spec: RunSpec) -> None:
    """``ValueError`` naming the bad value if ``spec``'s model does not divide by its train layout
    (the tools check it before any rank starts)."""
    from conversion.validate import check_train_layout

    check_train_layout(hf_config_for(spec), spec.train)


def _train_rank(rank: int, spec: RunSpec, cfg, refit_cfg):
    from conversion.refit import trainer_refit
    from conversion.testing.build import build_model, init_gloo, init_model_parallel
    from conversion.testing.train_step import train_step
    from megatron_refit.local.faults import HoldRefits
    from megatron_refit.local.progress import Bar

    if spec.device == "cuda" and spec.num_train == 1:  # NCCL, as Megatron trains (see RunSpec's checks)
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{spec.megatron_port}", rank=0,
                                             world_size=1, timeout=datetime.timedelta(seconds=spec.timeout_s))
    else:
        init_gloo(rank, spec.num_train, spec.megatron_port, timeout_s=spec.timeout_s)
    init_model_parallel(spec.train)
    built = build_model(cfg, spec.train, dtype=getattr(torch, spec.dtype))
    if spec.device == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
        for chunk in built.model:
            chunk.cuda()
    if spec.lora_rank:
        from conversion.lora import apply_lora

        built = replace(built, model=apply_lora(built.model, dim=spec.lora_rank, alpha=spec.lora_alpha))
    optimizer = None
    if spec.dtype == "bfloat16" and not (spec.lora_rank or spec.offload):
        # as Megatron trains in bf16: its DistributedOptimizer over fp32 main params, the bf16
        # params what the engine gets (a step below a bf16 ulp changes no element). Before the
        # refit enumerates: DDP moves the params into its buffers.
        from conversion.testing.megatron_optim import distributed_optimizer

        built, optimizer = distributed_optimizer(built, lr=spec.lr, clip_grad=0.0)
    params = [p for chunk in built.model for p in chunk.parameters()]
    if optimizer is None:
        optimizer = torch.optim.Adam([p for p in params if p.requires_grad], lr=spec.lr)
    offloader = None
    if spec.offload:
        from megatron_refit.endpoint.offload import ParamOffloader

        offloader = ParamOffloader(params)
    versions = range(1, spec.refits + 1)
    bar = Bar(versions, desc="refits") if spec.progress and rank == 0 else None
    fleet = trainer_refit(refit_cfg, built.bridge, built.model, cfg, rank=rank, num_train=spec.num_train,
                         offloader=offloader, on_report=bar.on_report if bar is not None else None)
    # the plan now: under overlap the last refit reads the replicas' leaves at its end
    summary, skipped = fleet.plan.summary(), list(fleet.plan.skipped_params)
    parallel = _built_parallel(built, fleet, rank)
    hold = HoldRefits(fleet, spec.timeout_s) if spec.hold_refits else None
    out = []
    joined = None  # train rank 0: the incarnations before a refit after which the experts move
    for version in bar or versions:
        if offloader is not None and offloader.offloaded:
            offloader.onload()
        loss = train_step(built, optimizer, tokens_for(version, cfg.vocab_size))
        if spec.overlap:
            if out:  # was the last refit still moving while this step changed the weights?
                out[-1]["overlapped"] = fleet.background.in_flight == version - 1
            if hold is not None:
                hold.stepped(version)
            out.append(_overlapped_item(spec, fleet, built, cfg, version, rank, loss))
            continue
        if offloader is not None:
            offloader.offload()  # between steps the parameters wait in host memory
            if any(p.numel() for p in params):
                raise RuntimeError("offload left parameters in place")
        if rank == 0 and version - 1 in spec.remap and spec.remap_rejoin:
            _await_rejoined(fleet, joined, spec.timeout_s)
        remapped = rank == 0 and version in spec.remap and spec.remap_rejoin
        joined = {r: fleet.joins.announced(r) for r in range(spec.gen.dp)} if remapped else None
        t0 = time.perf_counter()
        report = fleet.refit(version)
        wall = time.perf_counter() - t0  # what the training loop waited for (the serving check too)
        if offloader is not None:
            if not offloader.offloaded:  # the refit puts them back where it found them
                raise RuntimeError(f"refit {version} left offloaded parameters loaded")
            offloader.onload()  # for the checks below
        basis = fleet.plan.basis  # set with its holding where the plan was re-planned after the experts moved
        item = dict(report=report.as_dict(), loss=loss, failed_replicas=report.failed_replicas, wall_s=wall,
                    replanned=basis is not None and basis.holding is not None,
                    replans=sum(m.full.replans for m in fleet.members.values()))
        if spec.collect:
            item.update(_trainer_weights(spec, built, cfg, rank))
        out.append(item)
    if spec.overlap:
        if hold is not None:
            hold.stepped(float("inf"))
        fleet.background.wait()
        reports = {r.version: r for r in fleet.finished()}
        for item in out:
            item.update(report=reports[item.pop("version")].as_dict())
            item["failed_replicas"] = item["report"]["failed_replicas"]
    return dict(role="train", summary=summary, skipped=skipped, refits=out, parallel=parallel), fleet


def _await_rejoined(fleet, joined: dict, timeout_s: float) -> None:
    """Train rank 0, before the refit after a :attr:`RunSpec.remap`: every replica announced a new
    incarnation (its engine ranks rejoined with the moved experts), within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(fleet.joins.announced(r) == incarnation for r, incarnation in joined.items()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the replicas did not rejoin within {timeout_s} s after their experts moved")
        time.sleep(0.02)


def _built_parallel(built, fleet, rank: int) -> dict:
    """What Megatron built on this train rank, for the tests to hold against the layout: its
    parallel sizes and coordinates, each model chunk's decoder layers (0-based) and MTP layers,
    sequence parallelism, and the bytes this rank sends."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model

    layers = [[layer.layer_number - 1 for layer in get_attr_wrapped_model(chunk, "decoder").layers]
              for chunk in built.model]
    mtp = [len(get_attr_wrapped_model(chunk, "mtp").layers) if get_attr_wrapped_model(chunk, "mtp_process") else 0
           for chunk in built.model]
    return dict(cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
                pp_rank=ps.get_pipeline_model_parallel_rank(), sequence_parallel=built.config.sequence_parallel,
                layers=layers, mtp=mtp, bytes_sent=fleet.plan.train_bytes[rank])


def _overlapped_item(spec: RunSpec, fleet, built, cfg, version: int, rank: int, loss) -> dict:
    """``refit.overlap``: the weights at this step boundary (what refit ``version`` must land),
    then the refit started in the background (its report is read when training ends)."""
    item = dict(version=version, loss=loss, overlapped=False)
    if spec.collect:  # before the refit starts
        item.update(_trainer_weights(spec, built, cfg, rank))
    t0 = time.perf_counter()
    fleet.start_refit(version)
    item["start_s"] = time.perf_counter() - t0
    return item


def _trainer_weights(spec: RunSpec, built, cfg, rank: int) -> dict:
    """What the checks compare with: Bridge's export of the trainer's weights now (collective
    over the train ranks; kept on rank 0) and the trainer's logits."""
    from conversion.testing.train_step import forward_logits

    export = {n: t.detach().clone() for n, t in built.bridge.export_hf_weights(built.model, cpu=True,
                                                                                show_progress=False)}
    with _reference_weights(spec, built):
        logits = forward_logits(built, tokens_for(0, cfg.vocab_size))
    return dict(export=export if rank == 0 else None, logits=logits)


def _reference_weights(spec: RunSpec, built):
    """The weights the engine computes with: FP8-rounded under trainer-side quantization."""
    import contextlib

    if not spec.fp8:
        return contextlib.nullcontext()
    from conversion.serving import fp8_rounded_weights

    return fp8_rounded_weights(built.model)


def _gen_rank(gen_index: int, spec: RunSpec, cfg, refit_cfg):
    from megatron_refit.engine_side.entry import engine_refit

    balancer = Balancer(spec.gen.placement) if spec.remap and not spec.remap_rejoin else None
    backend = make_gen_backend(spec, cfg, gen_index, balancer=balancer)
    lora = (spec.lora_rank, spec.lora_alpha) if spec.lora_rank else None
    member = engine_refit(refit_cfg, backend, gen_index=gen_index, num_train=spec.num_train, device=spec.device,
                        lora=lora)
    size = spec.gen.deployment_size
    failing = spec.fail_replica and gen_index == spec.fail_replica[0] * size + spec.fail_rank
    fail_at = spec.fail_replica[1] if failing else None
    bad_map = spec.bad_map is not None and gen_index // size == spec.bad_map  # fails each refit after a move
    corrupting = [False]
    if spec.corrupt_forward is not None and gen_index == spec.corrupt_forward:
        from megatron_refit.local.faults import corrupt_forwarded

        corrupt_forwarded(member.group, corrupting, num_train=spec.num_train)
    armed = _failing(backend) if fail_at else [False]
    breaks = _breaking(backend, spec, gen_index)
    traffic = Traffic(backend, tokens_for(0, cfg.vocab_size)[:, :4]) if spec.traffic else None
    out = []
    for version in range(1, spec.refits + 1):
        armed[0] = version == fail_at
        corrupting[0] = version == 2
        for at, flag in breaks:
            flag[0] = version == at
        try:
            report = member.receive(version)
        except Exception as exc:
            if not spec.fails(gen_index, version):
                raise
            out.append(dict(report=None, error=f"{type(exc).__name__}: {exc}"))
            continue
        item = dict(report=report.as_dict(), serves=_serves(backend, cfg),
                    pause_s=backend.last_pause_s if isinstance(backend, StagedHFStorage) else None,  # its hold
                    gate_s=_gate_s(backend), traffic=traffic.take() if traffic else None)
        if spec.collect:
            weights = backend.state_dict_hf() if isinstance(backend, HFStorage) else backend.storage()
            item["weights"] = {name: t.cpu() for name, t in weights.items()}
            item["logits"] = backend.logits(tokens_for(0, cfg.vocab_size)) if item["serves"] is True else None
        out.append(item)
        if version in spec.remap and balancer is not None:  # EPLB moves the experts while the engine serves
            placement = spec.gen_at(version + 1, balancer.layers(backend)).placement
            if bad_map:  # a map of other slots than the refit was connected with
                placement = replace(placement, num_redundant=placement.num_redundant + 2 * placement.ep_size,
                                    physical_to_logical=())
            balancer.move(backend, placement)
        elif version in spec.remap:  # the deployment rejoins with its new map
            member.close()
            backend = make_gen_backend(spec, cfg, gen_index, version=version + 1)
            member = engine_refit(refit_cfg, backend, gen_index=gen_index, num_train=spec.num_train,
                                  device=spec.device)
    if traffic is not None:
        traffic.close()
    return dict(role="gen", gen_index=gen_index, refits=out), member


def _gate_s(backend) -> float | None:
    """Seconds this refit's version was live before its serving check's verdict (0.0: unchecked)."""
    if not isinstance(backend, WeightsState):
        return None
    seconds, backend.last_gate_s = backend.last_gate_s, 0.0
    return seconds


def _serves(backend, cfg) -> bool | str | None:
    """Whether the engine serves after a refit: True, the error it refuses with (a replica held
    after a failed serving check), or None where it has no forward here."""
    from megatron_refit.errors import StaleWeightsError

    if not isinstance(backend, HFStorage):
        return None
    try:
        backend.logits(tokens_for(0, cfg.vocab_size)[:, :4])
    except StaleWeightsError as exc:
        return str(exc)
    return True


def _breaking(storage, spec: RunSpec, gen_index: int) -> list[tuple[int, list[bool]]]:
    """:attr:`RunSpec.breaks` of this engine rank's replica: ``(version, armed flag)`` per break."""
    from megatron_refit.local.faults import break_post_load

    out = []
    for replica, version, how in spec.breaks:
        if gen_index // spec.gen.deployment_size == replica:
            armed = [False]
            break_post_load(storage, how, armed)
            out.append((version, armed))
    return out


def _failing(storage) -> list[bool]:
    """The engine error of :attr:`RunSpec.fail_replica`: while the returned flag is set,
    ``storage.buffer`` raises on its second call (bytes of that refit have landed by then)."""
    buffer, armed, calls = storage.buffer, [False], [0]

    def failing(name):
        calls[0] = calls[0] + 1 if armed[0] else 0
        if calls[0] == 2:
            raise RuntimeError("engine error while the refit lands (--fail-replica)")
        return buffer(name)

    storage.buffer = failing
    return armed


def make_gen_backend(spec: RunSpec, cfg, gen_index: int, *, version: int = 1, balancer: Balancer | None = None):
    """Engine rank ``gen_index``'s storage, laid out as refit ``version`` lands (:meth:`RunSpec.gen_at`);
    ``balancer``: the live expert map it reads at each refit."""
    dtype = getattr(torch, spec.dtype)
    if spec.gen.tp == 1 and not spec.wide:  # whole HF tensors; a wide deployment is vLLM-shaped
        if spec.swap == "staged":
            return StagedHFStorage.from_config(cfg, dtype=dtype, fp8=bool(spec.fp8), device=spec.device,
                                                budget_bytes=spec.swap_budget_bytes, draft=spec.draft)
        return HFStorage.from_config(cfg, dtype=dtype, fp8=bool(spec.fp8), device=spec.device, draft=spec.draft)
    from megatron_refit.engines.fused.layout import FusedLayoutStorage

    from megatron_refit.plan.deployment import moe_layers

    params = hf_param_table(cfg, dtype)
    if spec.fp8:
        params = fp8_param_table(params)
    gen = spec.gen_at(version, len(moe_layers(params)))
    return FusedLayoutStorage.allocate(params, gen, model_shape(cfg), gen_index=gen_index, device=spec.device,
                                       live_map=balancer)


def run(spec: RunSpec, *, quiet: bool = True) -> list[dict]:
    """Spawn train + gen ranks for ``spec``; returns every rank's result (rank order).
    ``quiet``: the ranks drop third-party warnings and chatter (see :mod:`megatron_refit.local.launch`)."""
    from megatron_refit.local.launch import free_ports, run_spawned

    megatron_port, refit_port = free_ports(2)
    spec = replace(spec, megatron_port=megatron_port)
    timeout = 180.0 + 60.0 * spec.refits
    return run_spawned(rank_main, spec.num_train + spec.num_gen, spec, timeout_s=timeout, port=refit_port,
                       quiet=quiet)
