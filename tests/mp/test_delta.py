"""Delta refits (``refit.delta``): the encodings, and Refitter/Receiver over gloo sending only
what changed — bit-exact after every refit, a full refit whenever a receiver missed a
version, ``auto`` going full when the change is dense."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.endpoint.delta import (AUTO_REMEASURE, AUTO_RETRY, BITMASK, INDICES, RAW, DeltaSender, encode,
                                           encode_cost_per_byte, pack_bits, sizes, unpack_bits)
from megatron_refit.endpoint.sender import TensorPiece
from megatron_refit.plan.spec import ShardSpec, box_along, full_box
from megatron_refit.local.launch import run_spawned

# -- encodings ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["host", "torch"])
@pytest.mark.parametrize("word", [1, 2, 4])
@pytest.mark.parametrize("changed", [0, 1, 37, 400, 4096])
def test_encode_then_apply_restores_the_new_bytes(word, changed, path):
    """Both implementations (numpy for host buckets, torch for device ones, run here on CPU)."""
    from megatron_refit.endpoint import delta

    encode_fn = (lambda n, o, w: delta._encode_host(n.numpy(), o.numpy(), w)) if path == "host" else \
        delta._encode_torch
    apply_fn = delta.apply if path == "host" else delta._apply_torch
    g = torch.Generator().manual_seed(changed * 10 + word)
    old = torch.randint(0, 256, (4096 * word,), dtype=torch.uint8, generator=g)
    new = old.clone()
    words = new.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[word])
    where = torch.randperm(words.numel(), generator=g)[:changed]
    words[where] ^= 1  # flip one bit: every chosen word differs
    previous = old.clone()
    encoding, payload, count = encode_fn(new, old, word)
    assert count == changed and torch.equal(old, new)  # the sender's copy is the new version now
    raw, indices, bitmask = sizes(4096, changed, word)
    if encoding == RAW:
        assert payload is None and min(indices, bitmask) >= raw
        return
    assert payload.numel() == min(indices, bitmask) < raw
    assert encoding == (INDICES if indices <= bitmask else BITMASK)
    apply_fn(previous, encoding, payload, word)
    assert torch.equal(previous, new)


def _bitmask_payload(count: int = 1003, word: int = 2):
    """A BITMASK payload of a bucket of ``count`` words (not a multiple of 8: the mask's last
    byte is partial and padding bytes follow), and the bytes before and after."""
    g = torch.Generator().manual_seed(count)
    old = torch.randint(0, 256, (count * word,), dtype=torch.uint8, generator=g)
    new = old.clone()
    new.view(torch.int16)[::6] ^= 1  # 1 word in 6: a bitmask beats indices
    encoding, payload, changed = encode(new, old.clone(), word)
    assert encoding == BITMASK and changed == -(-count // 6)
    return old, new, payload


@pytest.mark.parametrize("corrupt, problem", [
    (None, None),
    (lambda p, head: p.__setitem__(1003 // 8, p[1003 // 8] | 0x80), "mask bits past the bucket's 1003 words are set"),
    (lambda p, head: p.__setitem__(head - 1, 1), "mask bits past the bucket's 1003 words are set"),
    (lambda p, head: p.__setitem__(0, p[0] ^ 0x02), "the mask sets 169 words but 168 values follow"),
])
def test_a_bitmask_payload_is_checked_before_it_is_applied(corrupt, problem):
    from megatron_refit.endpoint.delta import apply, check_payload, mask_bytes

    old, new, payload = _bitmask_payload()
    head = mask_bytes(1003)
    assert head == 128 and payload.numel() == head + 168 * 2
    if corrupt is not None:
        corrupt(payload, head)
    assert check_payload(BITMASK, payload, old.numel(), 2) == problem
    if problem is None:  # a valid payload restores the new bytes
        apply(old, BITMASK, payload, 2)
        assert torch.equal(old, new)
    assert check_payload(BITMASK, payload[:-1], old.numel(), 2) == f"{payload.numel() - 1} bytes are not a " \
        f"{head}-byte mask then 2-byte values"


def test_encoding_choice_follows_density():
    old = torch.zeros(1 << 16, dtype=torch.uint8)
    sparse, dense, mid = old.clone(), old.clone(), old.clone()
    sparse[:10] = 1
    mid[::8] = 1
    dense[:] = 1
    assert encode(sparse, old.clone(), 1)[0] == INDICES
    assert encode(mid, old.clone(), 1)[0] == BITMASK  # 1/8 of the words: a bit each beats 5 bytes each
    assert encode(dense, old.clone(), 1)[0] == RAW
    assert torch.equal(unpack_bits(pack_bits(mid != 0), mid.numel()), mid != 0)


def test_sender_keeps_copies_and_a_failed_refit_leaves_no_base():
    sender = DeltaSender("on")
    data = torch.arange(64, dtype=torch.uint8)
    assert sender.encode((0, 0), data, 1, use_delta=False)[0] == RAW  # the first refit: full, copy kept
    assert sender.held_bytes() == 64
    sender.finish(1, ok=True, bytes_full=64, was_delta=False)
    assert sender.base == 1
    data[3] = 200
    encoding, payload, changed = sender.encode((0, 0), data, 1, use_delta=True)
    assert (encoding, changed) == (INDICES, 1) and payload.numel() == 5
    sender.finish(2, ok=False, bytes_full=64, was_delta=True)
    assert sender.base == -1  # a rank failed: the next refit is full


def _auto_run(sender, schedule, compare=2e-9, copy=0.0):
    """Drive ``sender`` (``auto``) through refits: ``schedule`` lists, per refit, (seconds per
    byte of the link, density of the change); a full refit costs the link's time for every
    byte, a delta the link's for the changed ones plus the comparison and the receiver's writes
    (``compare`` per byte each), a full refit that keeps its copies ``copy`` per byte more.
    Returns what each refit was: full, copy (full, copies kept) or delta."""
    out, B = [], 1_000_000
    for version, (link, density) in enumerate(schedule, start=1):
        delta = sender.keeps_copies and sender.base == version - 1
        kind = "delta" if delta else "copy" if sender.keeps_copies else "full"
        sent = int(B * density) if delta else B
        seconds = link * sent + (2 * compare * B if delta else copy * B if kind == "copy" else 0.0)
        sender.finish(version, ok=True, bytes_full=B, was_delta=delta, seconds=seconds,
                      rank_bytes=B)
        out.append(kind)
    return out


def test_auto_decides_from_measured_costs():
    # a link faster than the comparison: full refits, never a copy kept
    fast = DeltaSender("auto", encode_s_per_byte=2e-9)
    assert _auto_run(fast, [(1e-9, 0.01)] * 6) == ["full"] * 6 and fast.held_bytes() == 0
    # a slow link: after one measured full refit, one keeps its copies, then deltas
    slow = DeltaSender("auto", encode_s_per_byte=2e-9)
    assert _auto_run(slow, [(1e-8, 0.1)] * 5) == ["full", "copy", "delta", "delta", "delta"]
    assert slow.predicted() == (pytest.approx(1e-8 * 1e5 + 4e-3), pytest.approx(1e-2))
    # the prediction said yes but the measured delta does not pay (a slower comparison than
    # sampled): back to full refits, without copies
    wrong = DeltaSender("auto", encode_s_per_byte=2e-9)
    assert _auto_run(wrong, [(1e-8, 0.1)] * 5, compare=6e-9) == ["full", "copy", "delta", "full", "full"]
    assert wrong.held_bytes() == 0
    # a dense change (lr 1.0) on the slow link: full refits without copies; after AUTO_RETRY
    # of them it tries a delta again, and the change is sparse once more
    dense = DeltaSender("auto", encode_s_per_byte=2e-9)
    kinds = _auto_run(dense, [(1e-8, 0.1)] * 3 + [(1e-8, 0.99)] + [(1e-8, 0.1)] * (AUTO_RETRY + 3))
    assert kinds == ["full", "copy", "delta", "delta", *["full"] * AUTO_RETRY, "copy", "delta", "delta"]
    # the link slows down while it sends full refits: the last delta pays again
    slower = DeltaSender("auto", encode_s_per_byte=2e-9)
    kinds = _auto_run(slower, [(1e-8, 0.1)] * 3 + [(1e-8, 0.99)] + [(1e-7, 0.1)] * 3)
    assert kinds == ["full", "copy", "delta", "delta", "full", "copy", "delta"]
    # the link becomes fast while it sends deltas: the periodic full refit measures it, then full
    drift = DeltaSender("auto", encode_s_per_byte=2e-9)
    kinds = _auto_run(drift, [(1e-8, 0.1)] * 4 + [(1e-10, 0.1)] * (AUTO_REMEASURE + 4))
    assert kinds[:3] == ["full", "copy", "delta"] and kinds[-2:] == ["full", "full"]
    assert kinds.count("copy") == 1  # the remeasuring refit is a plain full one
    # the link stays slow: the remeasuring full refit, one that keeps copies again, deltas
    steady = DeltaSender("auto", encode_s_per_byte=2e-9)
    kinds = _auto_run(steady, [(1e-8, 0.1)] * (AUTO_REMEASURE + 6))
    assert kinds == ["full", "copy", *["delta"] * AUTO_REMEASURE, "full", "copy", "delta", "delta"]
    # a fast link where keeping the copies is slow (allocating them): that refit is not taken
    # for what a full refit costs, so the first measured delta ends the deltas
    costly = DeltaSender("auto", encode_s_per_byte=2e-10)
    kinds = _auto_run(costly, [(1e-9, 0.05)] * 6, compare=1e-9, copy=3e-9)
    assert kinds == ["full", "copy", "delta", "full", "full", "full"] and costly.held_bytes() == 0


def test_auto_predicts_the_comparison_before_its_first_delta():
    sender = DeltaSender("auto")
    assert sender.predicted() is None  # nothing measured yet: the first refit is full
    sender.finish(1, ok=True, bytes_full=10 << 20, was_delta=False, seconds=1.0,
                  rank_bytes=5 << 20)
    delta, full = sender.predicted()  # the comparison measured on a sample bucket
    assert 0 < sender.encode_s_per_byte < 1e-6 and delta == 2 * sender.encode_s_per_byte * (5 << 20) and full == 1.0
    assert sender.keeps_copies  # a 10 MB/s link: deltas pay, the next refit keeps its copies
    assert 1e-12 < encode_cost_per_byte() < 1e-6


def test_delta_mode_is_checked():
    with pytest.raises(ValueError, match=r"refit.delta: 'yes' is not one of \['off', 'on', 'auto'\]"):
        DeltaSender("yes")


# -- refits over gloo ------------------------------------------------------------------------

GLOBAL = {"w": ((64, 48), "bfloat16"), "b": ((48,), "bfloat16"), "s": ((16, 32), "bfloat16")}
NUM_TRAIN = 2


def _weights(step: int, lr: float) -> dict[str, torch.Tensor]:
    """bf16 / fp32 weights after ``step`` updates of an fp32 master copy by ``lr`` (few bf16
    elements cross a rounding boundary at small lr)."""
    out = {}
    for i, (name, (shape, dtype)) in enumerate(sorted(GLOBAL.items())):
        g = torch.Generator().manual_seed(i)
        master = torch.randn(shape, generator=g) * 0.02
        for s in range(step):
            master += lr * torch.randn(shape, generator=torch.Generator().manual_seed(100 * s + i))
        out[name] = master.to(getattr(torch, dtype))
    return out


class _Store:
    holds_sent_bytes = True  # plain storage: what the last refit wrote stays as it is

    def __init__(self):
        self.t = {n: torch.zeros(shape, dtype=getattr(torch, dtype)) for n, (shape, dtype) in GLOBAL.items()}
        self.fail_next = False

    def target_specs(self):
        return [ShardSpec(name=n, global_shape=s, dtype=d, box=full_box(s)) for n, (s, d) in GLOBAL.items()]

    def buffer(self, name):
        return self.t[name]

    def finalize(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("engine post-load failed (test)")


def _delta_rank(rank, world, port, mode, schedule, bucket_bytes):
    """``schedule``: (lr, event) per refit; events: "" or "fail-gen" (the last generation
    rank's post-load fails at that refit: it misses the version)."""
    from megatron_refit.endpoint.receiver import Receiver
    from megatron_refit.endpoint.sender import Refitter
    from megatron_refit.transport import ProcessGroupTransport

    group = ProcessGroupTransport.connect(host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=30)
    if mode == "auto" and rank < NUM_TRAIN:  # a slow link (40 kB/s): deltas pay unless the change is dense
        import time

        isend = group.isend

        def slow(buffer, peer, tag):
            time.sleep(buffer.numel() * buffer.element_size() / 40e3)
            return isend(buffer, peer, tag)

        group.isend = slow
    kw = dict(num_train=NUM_TRAIN, num_gen=world - NUM_TRAIN, bucket_bytes=bucket_bytes, direct_bytes=None,
              verify="full", delta=mode)
    out = []
    if rank < NUM_TRAIN:  # train TP2: row halves of 2-D tensors, 1-D replicated
        pieces = {}
        for name, (shape, dtype) in GLOBAL.items():
            box = full_box(shape) if len(shape) == 1 else box_along(shape, 0, rank * shape[0] // 2,
                                                                      (rank + 1) * shape[0] // 2)
            pieces[name] = TensorPiece(ShardSpec(name=name, global_shape=shape, dtype=dtype, box=box),
                                       torch.empty(0))
        ep = Refitter(group, list(pieces.values()), **kw)
        ep.prepare()
        step = 0
        for version, (lr, _) in enumerate(schedule, start=1):
            step += 1
            full = _weights(step, lr)
            for name, piece in pieces.items():
                piece.data = full[name][tuple(slice(a, b) for a, b in piece.spec.box)].clone()
            try:
                report = ep.refit(version)
                out.append(dict(ok=not report.failed_ranks, summary=report.summary, delta=report.delta,
                                sent=report.bytes_sent, full=report.bytes_full))
            except Exception as exc:  # noqa: BLE001 -- the test reads what the trainer raised
                out.append(dict(ok=False, error=type(exc).__name__))
        return dict(out=out, held=ep._delta.held_bytes())
    store = _Store()
    if mode == "on" and bucket_bytes == 1 << 20:  # an engine whose post-load may rewrite its weights
        store.holds_sent_bytes = False
    ep = Receiver(group, store, **kw)
    ep.prepare()
    step = 0
    for version, (lr, event) in enumerate(schedule, start=1):
        step += 1
        store.fail_next = event == "fail-gen" and rank == world - 1
        try:
            report = ep.receive(version)
            out.append(dict(ok=True, delta=report.delta, received=report.bytes_received))
        except Exception as exc:  # noqa: BLE001
            out.append(dict(ok=False, error=type(exc).__name__))
        want = _weights(step, lr)
        out[-1]["exact"] = all(torch.equal(store.t[n].view(torch.uint8), want[n].view(torch.uint8)) for n in GLOBAL)
    return dict(out=out)


@pytest.mark.slow
def test_delta_refits_are_exact_small_and_a_missed_version_gets_a_full_refit():
    schedule = [(1e-6, ""), (1e-6, ""), (1e-6, "fail-gen"), (1e-6, ""), (1e-6, "")]
    out = run_spawned(_delta_rank, 4, "on", schedule, 4096, timeout_s=120)
    train, gen = out[:NUM_TRAIN], out[NUM_TRAIN:]
    deltas = [r["summary"]["refit/delta"] for r in train[0]["out"]]
    # 1: full (nothing to start from); 2: delta; 3: delta, but the last gen rank fails to apply
    # it (the trainer's report names it); 4: full to that rank (it missed 3, decided before any
    # byte moved), still a delta to the other; 5: delta
    assert deltas == [0, 1, 1, 1, 1]
    assert [r["ok"] for r in train[0]["out"]] == [True, True, False, True, True]
    assert train[0]["out"][2]["summary"]["refit/ok"] == 0
    for g in gen:
        assert all(r["exact"] for r in g["out"] if r["ok"])
    assert [r["delta"] for r in gen[0]["out"]] == [False, True, True, True, True]
    assert [r["ok"] for r in gen[-1]["out"]] == [True, True, False, True, True]
    assert gen[-1]["out"][2]["error"] == "RuntimeError"  # its post-load failed: stale, version 3 missed
    assert [r.get("delta") for r in gen[-1]["out"]] == [False, True, None, False, True]
    for i in (1, 4):
        s = train[0]["out"][i]["summary"]
        assert s["refit/bytes"] <= 0.1 * s["refit/bytes_full"] and 0 < s["refit/density"] < 0.05, s
        assert s["refit/bytes_full"] == s["refit/bytes_minimal"]
    s = train[0]["out"][3]["summary"]  # the missed rank's half in full, the other's as a delta
    assert 0.45 * s["refit/bytes_full"] <= s["refit/bytes"] <= 0.6 * s["refit/bytes_full"], s
    # host memory: a copy of what each train rank sends
    assert sum(t["held"] for t in train) >= train[0]["out"][0]["summary"]["refit/bytes_full"]


@pytest.mark.slow
def test_an_engine_that_may_rewrite_its_weights_gets_full_refits():
    out = run_spawned(_delta_rank, 3, "on", [(1e-6, ""), (1e-6, ""), (1e-6, "")], 1 << 20, timeout_s=120)
    assert [r["summary"]["refit/delta"] for r in out[0]["out"]] == [0, 0, 0]
    assert all(r["exact"] for r in out[2]["out"])


@pytest.mark.slow
def test_auto_sends_deltas_over_a_slow_link():
    """``auto`` through real refits over a slow link (40 kB/s): the first refit full (its time
    measured), the second keeps its copies, deltas from the third, each far smaller and faster
    than a full refit. (Going back to full refits: the unit tests above, with set costs.)"""
    schedule = [(1e-6, "")] * 5
    out = run_spawned(_delta_rank, 3, "auto", schedule, 1 << 20, timeout_s=120)
    summaries = [r["summary"] for r in out[0]["out"]]
    assert [s["refit/delta"] for s in summaries] == [0, 0, 1, 1, 1]
    for s in summaries[2:]:
        assert s["refit/bytes"] < 0.1 * s["refit/bytes_full"] and s["refit/total_s"] < summaries[0]["refit/total_s"]
    assert all(r["exact"] for r in out[2]["out"])
    assert out[0]["held"] > 0  # sending deltas: the copies are kept


# -- end to end: Megatron trainer (bf16, fp32 main params) -> engines ----------------------

E2E = [  # (id, RunSpec fields)
    ("qwen3-TP2-to-HF-TP1xDP2", dict(model="qwen3")),
    ("qwen3moe-EP2-to-vllm-TP2", dict(model="qwen3-moe", train=dict(tp=1, ep=2, dp=2), gen=dict(tp=2, dp=1))),
    ("qwen3-FP8-to-HF", dict(model="qwen3", fp8="trainer", gen=dict(tp=1, dp=1),
                             overrides=dict(hidden=256, heads=2, kv_heads=2, head_dim=128, ffn=512, vocab=256,
                                            layers=2))),
    ("qwen3-colocated", dict(model="qwen3", train=dict(tp=1), gen=dict(tp=1, dp=1), colocated=True)),
]


def _spec(fields):
    from megatron_refit.plan.gen_layout import GenLayout
    from megatron_refit.plan.layout import TrainLayout
    from megatron_refit.local.harness import RunSpec

    fields = dict(fields)
    train = TrainLayout(**fields.pop("train", dict(tp=2)))
    gen = GenLayout(**fields.pop("gen", dict(tp=1, dp=2)))
    fields = dict(dict(dtype="bfloat16", lr=1e-6, delta="on", refits=3, bucket_bytes=64 << 10), **fields)
    return RunSpec(train=train, gen=gen, **fields)


@pytest.mark.slow
@pytest.mark.parametrize("fields", [f for _, f in E2E], ids=[i for i, _ in E2E])
def test_delta_refit_end_to_end_is_bit_exact_and_small(fields):
    """bf16 training with fp32 main params at lr 1e-6: after the first refit only the
    changed elements travel, and the engine's weights equal Bridge's export bit for bit."""
    from megatron_refit.local.evaluate import evaluate
    from megatron_refit.local.harness import run

    spec = _spec(fields)
    result = evaluate(spec, run(spec))
    assert result["bit_exact"] is True
    first, *rest = result["refits"]
    assert not first["delta"] and first["bytes_sent"] == first["bytes_minimal"] == first["bytes_full"]
    for r in rest:
        assert r["delta"] and r["bytes_sent"] <= 0.1 * r["bytes_full"], r
        assert 0 < r["density"] < 0.1


@pytest.mark.slow
def test_lora_delta_sends_changed_adapter_elements_only():
    from megatron_refit.local.evaluate import evaluate
    from megatron_refit.local.harness import run

    spec = _spec(dict(model="qwen3", gen=dict(tp=1, dp=1), lora_rank=4, refits=4))
    result = evaluate(spec, run(spec))
    assert result["bit_exact"] is True
    r1, r2, r3, r4 = result["refits"]
    assert not r1["delta"] and not r2["delta"]  # base + adapters; then the first adapters-only refit
    assert r2["bytes_sent"] == r2["bytes_full"] < r1["bytes_full"]
    for r in (r3, r4):  # adapters only, and of them only what changed
        assert r["delta"] and r["bytes_sent"] < r["bytes_full"] == r2["bytes_full"]


def test_yaml_reads_delta_off_and_on_as_the_modes():
    from megatron_refit.config import RefitConfig

    assert RefitConfig.from_dict({"enabled": True, "delta": False}).delta == "off"
    assert RefitConfig.from_dict({"enabled": True, "delta": True}).delta == "on"
    assert RefitConfig.from_dict({"enabled": True, "delta": "auto"}).delta == "auto"
    with pytest.raises(ValueError, match=r"refit.delta: 'sometimes' is not one of \['off', 'on', 'auto'\]"):
        RefitConfig.from_dict({"enabled": True, "delta": "sometimes"})
