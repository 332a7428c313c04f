"""A tiny GRPO loop on CPU, the refit inside Megatron-Bridge's training callbacks.

The layout and the refit switch come from a training YAML (``--config``, default
``configs/examples/grpo_tiny.yaml``: Bridge's ``model:`` section plus ``refit: {enabled:
true, ...}``, read with ``load_training_yaml``, which also takes dotted overrides such as
``--set refit.bucket_mb=2``). The train ranks train the way Megatron does: model chunks
wrapped in Megatron's ``DistributedDataParallel``, stepped by Megatron's distributed
optimizer; the refit is a ``RefitCallback`` fired through Bridge's ``CallbackManager``
(``on_train_start`` sends the starting weights, ``on_train_step_end`` every update). The
generation rank (Hugging Face transformers) calls ``engine_refit`` and ``receive(step)``.

Train ranks (Megatron-Core policy built through Megatron-Bridge, train TP2) and one
generation rank share a gloo refit group. Each step ``k``:

1. rollouts: the generation rank, holding the policy after ``k - 1`` updates (version
   ``k - 1``), samples ``--group`` completions for each of ``--prompts`` prompts, with
   their token logprobs;
2. the trainer recomputes the same sequences' token logprobs with Megatron and checks
   them against the generation side's (fp32: max |diff| <= 1e-5) — the refit delivered the
   trainer's policy exactly;
3. reward (toy and verifiable): the fraction of completion tokens equal to a target token;
   group-normalised advantages; a clipped policy-gradient loss; backward and one step of
   Megatron's optimizer on the trainer;
4. Bridge's ``on_train_step_end``: the callback refits version ``k``.

``--json``: last line ``{"ok", "steps", "logprob_match", "max_logprob_diff",
"refit_seconds", "refit_report_seconds", "rewards", "draft_acceptance",
"draft_greedy_acceptance"}``: ``refit_seconds`` is the wall time of the trainer's callback /
the engine's ``receive`` call (including waiting for the other side to finish its training step
or rollouts), ``refit_report_seconds`` the refit itself (``RefitReport``'s total, after the ranks
agreed on the version); both the slowest rank's.
Per-step metrics go to stdout; ``--png PATH`` draws the refit itself and the reward per
step (needs matplotlib: the ``plots`` extra).

**With a speculative draft** (``--config configs/examples/grpo_tiny_mtp.yaml``, #67): a ``model:``
section with ``mtp_num_layers: 1`` trains the tiny DeepSeek-V3 with one MTP layer instead of the
tiny Qwen3, and ``refit.gen_draft: true`` builds the generation rank's engine with that layer as its
speculative draft (``HFStorage.from_config(draft=True)``), refitted with the model every step
(without ``gen_draft`` the refit skips the MTP layer by name). Megatron trains the MTP layer on the
rollouts itself: given no labels, its ``process_mtp_loss`` takes the sequences' own next tokens and
adds ``mtp_loss_scaling_factor`` (Megatron's default 0.1; ``model.mtp_loss_scaling_factor`` sets
it; at 0 the layer gets no gradient, only Adam's weight decay moves it) times the MTP layer's
cross-entropy of the token after the next to the policy-gradient loss. The printed loss is the
policy loss alone; the MTP loss's gradient reaches the main model too (through its hidden states,
embedding and output head). Each step the generation rank scores the draft the refit just
delivered on the rollouts it sampled (``HFStorage.draft_acceptance`` over every completion token
after the first: the ones a decoder drafts): ``accept`` is the expected acceptance of one drafted
token under speculative sampling at temperature 1 (``sum_x min(p(x), q(x))`` of the model's ``p``
and the draft's ``q``, averaged over those positions), ``greedy`` the share where the draft's
argmax is the model's. The HF engine does not speculate: these are the acceptance an engine
drafting one token at a time with the refitted layer would expect on these rollouts. ``--json``
adds ``draft_acceptance`` and ``draft_greedy_acceptance``, one value per step (null without a
draft). The log-prob check holds the DeepSeek-V3 to the same 1e-5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from pathlib import Path

import torch

from megatron_refit.tools.cli import reports_user_errors

LOGPROB_TOLERANCE = 1e-5
"""Largest |trainer - generation| token log-prob (fp32), both models (the tiny DeepSeek-V3: at most
9.5e-7 measured, as the Qwen3's)."""
MODEL = dict(vocab=16, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=96)
DRAFT_MODEL = dict(vocab=16, num_nextn_predict_layers=1)
"""The tiny DeepSeek-V3 preset with one MTP layer (and the toy task's vocabulary), for a ``model:``
section with ``mtp_num_layers: 1``."""
MTP_LOSS_KEYS = ("mtp_loss_scaling_factor",)
"""``model:`` keys of Megatron's MTP loss the trainer applies; the layout accepts the others
(``mtp_detach_heads`` …: they move no weight), which this example refuses."""


CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "examples" / "grpo_tiny.yaml")
TARGET = 7
"""The token the toy reward asks for."""


def rewards(sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Verifiable reward per sequence: share of completion tokens equal to ``TARGET``."""
    return (sequences[:, prompt_len:] == TARGET).float().mean(dim=1)


def advantages(reward: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO: rewards normalised within each prompt's group of samples."""
    r = reward.view(-1, group)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-6)).view(-1)


def token_logprobs(logits: torch.Tensor, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probabilities of the completion tokens ``[batch, completion_len]`` (float32)."""
    logp = torch.log_softmax(logits.float()[:, prompt_len - 1 : -1], dim=-1)
    return logp.gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)


def policy_loss(logits, sequences, prompt_len, old_logprobs, adv, clip=0.2) -> torch.Tensor:
    ratio = torch.exp(token_logprobs(logits, sequences, prompt_len) - old_logprobs)
    unclipped, clipped = ratio * adv[:, None], ratio.clamp(1 - clip, 1 + clip) * adv[:, None]
    return -torch.minimum(unclipped, clipped).mean()


def _rank(rank, world, port, args):
    from megatron_refit.local.harness import hf_config_for

    cfg = hf_config_for(args.spec)
    if rank < args.spec.num_train:
        return _train(rank, args, cfg)
    return _generate(rank, args, cfg)


def _train(rank, args, cfg):
    from conversion.testing.build import build_model, init_gloo, init_model_parallel
    from conversion.testing.megatron_optim import distributed_optimizer
    from conversion.refit_callback import RefitCallback
    from conversion.testing.train_step import forward_logits, train_step
    from megatron.bridge.training.callbacks import CallbackContext, CallbackManager  # after conversion's TE shim
    from megatron_refit.local.progress import Bar

    spec, num_train = args.spec, args.spec.num_train
    init_gloo(rank, num_train, args.megatron_port)
    init_model_parallel(spec.train)
    torch.manual_seed(0)
    built, optimizer = distributed_optimizer(build_model(cfg, spec.train), lr=args.lr)  # DDP + Megatron's optimizer
    for key, value in args.mtp_loss.items():  # read by Megatron's process_mtp_loss at every forward
        setattr(built.config, key, value)
    callbacks = CallbackManager()
    refit = RefitCallback.from_config(args.refit, built.bridge)
    callbacks.add(refit)
    state = types.SimpleNamespace(train_state=types.SimpleNamespace(step=0))  # what callbacks read of GlobalState

    def event(name: str, **kw) -> float:
        t0 = time.perf_counter()
        callbacks.fire(name, CallbackContext(state=state, model=built.model, user_state=callbacks.user_state,
                                             optimizer=optimizer, **kw))
        return time.perf_counter() - t0

    refit_s = event("on_train_start")  # the starting weights, version 0
    metrics = []
    steps = range(1, args.steps + 1)
    bar = Bar(steps, desc="GRPO steps") if rank == 0 else None
    for step in bar or steps:
        # the generation rank's rollouts to every rank (one small object per step)
        sequences, gen_logprobs = refit.fleet.group.all_gather_object(None)[num_train]
        train_logprobs = token_logprobs(forward_logits(built, sequences), sequences, args.prompt_len)
        diff = float((train_logprobs - gen_logprobs).abs().max())
        reward = rewards(sequences, args.prompt_len)
        adv = advantages(reward, args.group)
        report = refit.last_report  # the refit that delivered this step's rollout policy
        metrics.append(dict(step=step, refit_s=refit_s, report_s=report.seconds["total"], bytes=report.bytes_sent,
                            reward=float(reward.mean()), max_logprob_diff=diff))
        metrics[-1]["loss"] = train_step(built, optimizer, sequences, loss_fn=lambda logits: policy_loss(
            logits, sequences, args.prompt_len, gen_logprobs, adv))
        refit_s = event("on_train_step_end", skipped_iter=False)  # refits version `step`
        state.train_state.step += 1
        if bar is not None:
            bar.show(reward=f"{metrics[-1]['reward']:.3f}", refit_s=f"{metrics[-1]['refit_s']:.3f}")
    event("on_train_end")
    return metrics


def _generate(rank, args, cfg):
    from megatron_refit.engine_side.entry import engine_refit
    from megatron_refit.engines.hf.storage import HFStorage

    num_train = args.spec.num_train
    backend = HFStorage.from_config(cfg, draft=args.spec.draft)
    member = engine_refit(args.refit, backend, gen_index=rank - num_train, num_train=num_train)
    g = torch.Generator().manual_seed(1234)
    metrics = []
    for step in range(1, args.steps + 2):
        start = time.perf_counter()
        report = member.receive(step - 1)  # the policy after step - 1 updates
        metrics.append(dict(step=step, refit_s=time.perf_counter() - start, report_s=report.seconds["total"],
                            bytes=report.bytes_received))
        if step <= args.steps:
            rollouts = _rollouts(backend, g, args, cfg.vocab_size)
            member.group.all_gather_object(rollouts)
            if backend.draft is not None:  # the draft the refit just delivered, on what its model sampled
                drafted = backend.draft_acceptance(rollouts[0], start=args.prompt_len + 1)
                metrics[-1].update(acceptance=drafted["expected"], greedy=drafted["greedy"])
    member.close()
    return metrics[: args.steps]


@torch.no_grad()
def _rollouts(backend, g: torch.Generator, args, vocab: int):
    """Sample ``group`` completions per prompt with the generation model, and their logprobs."""
    prompts = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=g)
    seq = prompts.repeat_interleave(args.group, dim=0)
    for _ in range(args.completion_len):
        logits = backend.logits(seq)[:, -1]
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)
        seq = torch.cat([seq, nxt], dim=1)
    return seq, token_logprobs(backend.logits(seq), seq, args.prompt_len)


def _from_config(path: str, port: int, overrides: list[str]):
    """The run's layout and refit config from a training YAML (see ``configs/examples``)."""
    from dataclasses import replace

    from conversion.presets import hf_config, num_routed_experts
    from megatron_refit.config import load_training_yaml, train_layout
    from megatron_refit.config.bridge_model import INERT
    from megatron_refit.plan.gen_layout import GenLayout
    from megatron_refit.local.harness import RunSpec

    bridge_config, refit = load_training_yaml(path, overrides)
    if not refit.enabled:
        raise SystemExit(f"error: {path}: refit.enabled is false; this example checks every refit, turn it on")
    if refit.engine != "hf" or refit.gen_tp * refit.gen_dp != 1:
        raise SystemExit(f"error: {path}: this example runs one Hugging Face generation rank (engine hf, gen_tp 1, "
                         f"gen_dp 1), got engine {refit.engine!r}, gen_tp {refit.gen_tp}, gen_dp {refit.gen_dp}")
    mtp = train_layout(bridge_config, refit).mtp_layers  # the section's keys checked here
    if mtp > 1:
        raise ValueError(f"{path}: model.mtp_num_layers={mtp}: this example's model has one MTP layer (1, or 0 "
                         "for none)")
    if refit.gen_draft and not mtp:
        raise ValueError(f"{path}: refit.gen_draft: the engine drafts with the trainer's MTP layer; set "
                         "model.mtp_num_layers: 1 (the tiny DeepSeek-V3 with one MTP layer)")
    model, shape = ("deepseek-v3", DRAFT_MODEL) if mtp else ("qwen3", MODEL)
    section = bridge_config.get("model") or {}
    loss = {key: value for key, value in section.items() if key in INERT and key.startswith("mtp_")
            and value is not None}  # accepted by the layout (they move no weight), and up to this example
    for key, value in loss.items():
        if key not in MTP_LOSS_KEYS or not mtp:
            raise ValueError(f"{path}: model.{key}={value!r}: this example applies "
                             f"{', '.join(f'model.{k}' for k in MTP_LOSS_KEYS)} of Megatron's MTP loss, with "
                             "model.mtp_num_layers: 1, and no other MTP setting")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{path}: model.{key}: expected a non-negative number, got {value!r}")
    layout = train_layout(bridge_config, refit, num_experts=num_routed_experts(hf_config(model, **shape)))
    spec = RunSpec(model=model, overrides=shape, train=layout, gen=GenLayout(tp=1, dp=1), draft=refit.gen_draft)
    return spec, replace(refit, host="127.0.0.1", port=port), {key: float(value) for key, value in loss.items()}


@reports_user_errors
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=4)
    p.add_argument("--completion-len", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-2)
    p.add_argument("--png", metavar="PATH", help="write a chart of refit seconds and reward per step (matplotlib)")
    p.add_argument("--config", default=CONFIG,
                   help="training YAML: Bridge's model: section (tensor_model_parallel_size) and the refit: section")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override of the training YAML, e.g. --set refit.bucket_mb=2 (repeatable)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for name in ("steps", "prompts", "group", "prompt_len", "completion_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.group < 2:
        raise ValueError(f"--group must be >= 2 for group-normalised advantages, got {args.group}")
    if args.png:
        from megatron_refit.tools.plots import require_matplotlib

        require_matplotlib()
    from megatron_refit.local.harness import check_layout
    from megatron_refit.local.launch import free_ports, run_spawned

    args.megatron_port, refit_port = free_ports(2)
    args.spec, args.refit, args.mtp_loss = _from_config(args.config, refit_port, args.set)
    if args.spec.draft and args.completion_len < 2:
        raise ValueError(f"--completion-len must be >= 2 with a draft (it drafts the completion's tokens after the "
                         f"first), got {args.completion_len}")
    check_layout(args.spec)
    world = args.spec.num_train + 1
    out = run_spawned(_rank, world, args, timeout_s=600, port=refit_port)
    train, gen = out[0], out[-1]
    draft = args.spec.draft
    print(f"{'step':>4} {'reward':>7} {'loss':>9} {'call s':>8} {'refit s':>8} {'bytes':>10} {'max|dlogp|':>10}"
          + (f" {'accept':>7} {'greedy':>7}" if draft else ""))
    for t, gm in zip(train, gen):
        print(f"{t['step']:>4} {t['reward']:7.3f} {t['loss']:9.1e} {max(t['refit_s'], gm['refit_s']):8.3f} "
              f"{max(t['report_s'], gm['report_s']):8.3f} {sum(o[t['step'] - 1]['bytes'] for o in out[:-1]):>10,} "
              f"{t['max_logprob_diff']:10.2e}" + (f" {gm['acceptance']:7.3f} {gm['greedy']:7.3f}" if draft else ""))
    print("call s: the refit / receive call, waiting for the other side included; refit s: the refit itself")
    if draft:
        print("accept: the draft's expected acceptance of one drafted token (speculative sampling, temperature 1) "
              "on the step's rollouts, completion tokens after the first; greedy: the share where its argmax is "
              "the model's")
    print("loss: the clipped policy-gradient loss of the step; on policy (one step per batch: ratio 1) it is minus the "
          "mean of group-normalised advantages, 0 up to rounding by construction, while its gradient is not")
    diffs = [m["max_logprob_diff"] for m in train]
    result = dict(
        steps=len(train),
        logprob_match=max(diffs) <= LOGPROB_TOLERANCE,
        max_logprob_diff=max(diffs),
        refit_seconds=[max(t["refit_s"], gm["refit_s"]) for t, gm in zip(train, gen)],
        refit_report_seconds=[max(t["report_s"], gm["report_s"]) for t, gm in zip(train, gen)],
        rewards=[t["reward"] for t in train],
        draft_acceptance=[gm["acceptance"] for gm in gen] if draft else None,
        draft_greedy_acceptance=[gm["greedy"] for gm in gen] if draft else None,
    )
    result = dict(ok=result["logprob_match"] and len(train) == args.steps, **result)
    print(f"reward {result['rewards'][0]:.3f} -> {result['rewards'][-1]:.3f} (mean of last 3: "
          f"{statistics.mean(result['rewards'][-3:]):.3f}); logprobs match: {result['logprob_match']}")
    if args.png:
        from megatron_refit.tools.plots import grpo_chart

        grpo_chart(result["refit_report_seconds"], result["rewards"], args.png)
        print(f"chart: {args.png}")
    if args.json:
        print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
