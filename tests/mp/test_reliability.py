"""Failure modes: errors before any weight moves, no hangs when a peer dies mid-refit,
corruption detected by ``verify``, and generation refused while weights are stale."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_refit.plan.spec import ShardSpec
from megatron_refit.local.launch import SpawnError, run_spawned
from megatron_refit.testing.toy_group import exact as holds_version
from megatron_refit.testing.toy_group import NAMES, NUM_GEN, NUM_TRAIN, FaultyPiece, die_after, gen_storage, \
    train_pieces

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

TIMEOUT_S = 6.0


def _rank(rank, world, port, scenario):
    from megatron_refit.endpoint.receiver import Receiver
    from megatron_refit.endpoint.sender import Refitter
    from megatron_refit.transport import ProcessGroupTransport

    group_cls = ProcessGroupTransport
    if scenario == "corrupt":
        from megatron_refit.endpoint.stages import DIGEST_TAG

        class Corrupting(ProcessGroupTransport):
            """What travels of bucket 1 (what the sender's digest was computed over is untouched):
            version 2 one flipped byte; version 3 zeros, the digest message zeroed too;
            version 4 version 1's bucket and digests replayed (stale, but internally consistent)."""

            version = 0
            stash: dict = {}

            def isend(self, buffer, peer, tag):
                key = (peer, tag)
                if tag in (1, DIGEST_TAG) and self.version == 1:
                    self.stash[key] = buffer.clone()
                if tag == 1 and self.version == 2:
                    buffer = buffer.clone()
                    buffer[3] ^= 0x40
                elif tag in (1, DIGEST_TAG) and self.version == 3:
                    buffer = torch.zeros_like(buffer)
                elif tag in (1, DIGEST_TAG) and self.version == 4:
                    buffer = self.stash[key]
                return super().isend(buffer, peer, tag)
        group_cls = Corrupting
    if scenario in ("fingerprint-mismatch", "pair-mismatch") and rank == NUM_TRAIN + 1:
        from megatron_refit.plan.refit_plan import RefitPlan

        # a rank whose plan differs (e.g. another package version): only its fingerprints show it,
        # all of them or those of one pair it is an end of
        honest = RefitPlan.fingerprints

        def fingerprints(self):
            prints = honest(self)
            if scenario == "fingerprint-mismatch":
                prints["plan"] = "0" * 16
            else:
                prints[min(pair for pair in prints if pair != "plan")] = "0" * 16
            return prints
        RefitPlan.fingerprints = fingerprints
    group = group_cls.connect(host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=TIMEOUT_S)
    verify = "full" if scenario == "verify-mismatch" and rank == 0 else "sampled"  # the default
    kw = dict(num_train=NUM_TRAIN, num_gen=NUM_GEN, bucket_bytes=2048, verify=verify)
    if scenario == "stall-mismatch":  # refit.stall_s in force: 30 on the train ranks, off on the engine's
        kw["stall_s"] = 30.0 if rank < NUM_TRAIN else 0.0
    if rank < NUM_TRAIN:
        on_read = die_after(3) if scenario == "kill-train" and rank == 1 else None
        names = NAMES if scenario != "unused-name" else NAMES | {}
        pieces = train_pieces(rank, on_read, names)
        if scenario == "unused-name":
            pieces.append(FaultyPiece(ShardSpec(name="extra.bias", global_shape=(4,), dtype="float32", box=((0, 4),)),
                                 torch.zeros(4)))
        endpoint, step = Refitter(group, pieces, **kw), "refit"
    else:
        on_write = die_after(3) if scenario == "kill-gen" and rank == NUM_TRAIN else None
        backend = gen_storage()
        endpoint, step = Receiver(group, backend, **kw), "receive"
    endpoint.prepare()  # reads the engine buffers' addresses: the crash or stall is armed after it
    if rank >= NUM_TRAIN:
        backend.on_buffer = on_write
    outcome = []
    for version in (1, 2, 3, 4, 5) if scenario == "corrupt" else (1, 2, 3):
        if scenario == "corrupt":
            group.version = version
        start = time.monotonic()
        try:
            report = getattr(endpoint, step)(version)
            failed = "; ".join(f"{r}: {why}" for r, why in sorted(report.failed_ranks.items()))
            outcome.append(("ok" if not failed else "failed", failed, time.monotonic() - start,
                            getattr(endpoint, "state", None)))
        except Exception as exc:  # noqa: BLE001 -- the test inspects what each survivor raised
            outcome.append((type(exc).__name__, str(exc), time.monotonic() - start, getattr(endpoint, "state", None)))
            if scenario.startswith("kill"):
                break
    if rank >= NUM_TRAIN:
        exact = holds_version(backend)
        return dict(outcome=outcome, exact=exact, backend_state=backend.state)
    return dict(outcome=outcome)


@pytest.mark.parametrize("victim", ["kill-gen", "kill-train"])
def test_peer_death_mid_refit_raises_within_timeout(victim):
    dead = NUM_TRAIN if victim == "kill-gen" else 1
    start = time.monotonic()
    out = run_spawned(_rank, NUM_TRAIN + NUM_GEN, victim, timeout_s=120, may_die=frozenset({dead}))
    assert out[dead] is None
    for rank, res in enumerate(out):
        if rank == dead:
            continue
        first = res["outcome"][0]
        kind, msg, seconds, state = first
        # every survivor either finished before the death mattered to it, or raised a
        # transport error (peer closed / timed out) within the bound
        assert kind in ("ok", "RefitTimeoutError", "RefitTransportError"), (rank, first)
        assert seconds <= TIMEOUT_S + 5, (rank, first)
        if kind != "ok":
            assert "refit rank" in msg
        if rank >= NUM_TRAIN and kind != "ok":
            assert state == "stale" and res["backend_state"] == "stale"
    assert any(res and res["outcome"][0][0] != "ok" for r, res in enumerate(out) if r != dead)
    assert time.monotonic() - start < 100


def test_corrupted_zeroed_or_stale_bucket_is_detected_by_name_and_next_refit_restores():
    """The integrity check is on by default: a flipped byte, a zeroed bucket whose digest
    message was zeroed too, and a replay of an older refit's bucket with its own (then valid)
    digests are each caught on every generation rank that got them, naming the parameters;
    the weights are stale until the next refit restores them."""
    out = run_spawned(_rank, NUM_TRAIN + NUM_GEN, "corrupt", timeout_s=120)
    for res in out[NUM_TRAIN:]:
        v1, v2, v3, v4, v5 = res["outcome"]
        assert v1[0] == "ok" and v1[3] == "ready"
        for bad in (v2, v3, v4):
            assert bad[0] == "RefitCorruptionError", bad
            assert "digest mismatch in" in bad[1] and "layer" in bad[1] and "refit rank" in bad[1]
            assert bad[3] == "stale"
        assert v5[0] == "ok" and v5[3] == "ready"
        assert res["exact"] and res["backend_state"] == "ready"
    for res in out[:NUM_TRAIN]:  # the trainer learns of it: no refit reports success while the engine is stale
        v1, v2, v3, v4, v5 = res["outcome"]
        assert v1[0] == v5[0] == "ok"
        for bad in (v2, v3, v4):  # its report names the failed ranks (what to do is the fleet's policy)
            assert bad[0] == "failed" and "RefitCorruptionError: refit" in bad[1], bad
            assert "digest mismatch" in bad[1], bad  # and why


def test_trainer_name_unknown_to_receiver_is_refused_before_transfer():
    with pytest.raises(SpawnError, match=r"no generation rank holds .*extra\.bias"):
        run_spawned(_rank, NUM_TRAIN + NUM_GEN, "unused-name", timeout_s=120)


def test_verify_flag_must_agree():
    with pytest.raises(SpawnError, match=r"disagree on verify"):
        run_spawned(_rank, NUM_TRAIN + NUM_GEN, "verify-mismatch", timeout_s=120)


def test_stall_s_must_agree_and_the_error_names_both_sides():
    with pytest.raises(SpawnError, match=r"the train ranks' refit.stall_s in force is 30 s but the engine ranks' is "
                                         r"0 s"):
        run_spawned(_rank, NUM_TRAIN + NUM_GEN, "stall-mismatch", timeout_s=120)


def test_hf_receiver_refuses_to_generate_while_stale():
    from transformers import Qwen3Config

    from megatron_refit.errors import StaleWeightsError
    from megatron_refit.engines.hf.storage import HFStorage

    cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    recv = HFStorage.from_config(cfg)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(StaleWeightsError, match="stale"):
        recv.logits(tokens)
    recv.set_state("updating", None)
    with pytest.raises(StaleWeightsError, match="updating"):
        recv.logits(tokens)
    recv.set_state("ready", 3)
    assert recv.logits(tokens).shape == (1, 4, 32)


def test_plan_fingerprint_mismatch_is_refused_before_transfer():
    # every rank sees every rank's fingerprints and names the odd one out
    with pytest.raises(SpawnError, match=r"refit plan fingerprint mismatch on refit ranks \[3\]"):
        run_spawned(_rank, NUM_TRAIN + NUM_GEN, "fingerprint-mismatch", timeout_s=120)
    # one pair held differently at its two ends: both ends are named (either may be wrong)
    with pytest.raises(SpawnError, match=r"refit plan fingerprint mismatch on refit ranks \[0, 3\]"):
        run_spawned(_rank, NUM_TRAIN + NUM_GEN, "pair-mismatch", timeout_s=120)
