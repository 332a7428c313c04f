"""The refit group's protocol and rendezvous: ranks in different calls stop with an error
naming both sides (this used to abort the trainer with SIGABRT), a duplicate rank or a
world-size mismatch is named at connect, a timed-out group says it is broken until the ranks
reconnect, and the store listens only where it was told to."""

from __future__ import annotations

import time

import pytest
import torch

from megatron_refit.local.launch import run_spawned
from megatron_refit.testing.toy_group import exact as holds_version
from megatron_refit.testing.toy_group import NUM_GEN, NUM_TRAIN, gen_storage, stall_after, train_pieces

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

TIMEOUT_S = 4.0


def _outcome(fn):
    start = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001 -- the test inspects what each rank raised
        return (type(exc).__name__, str(exc), time.monotonic() - start)


def _endpoint(rank, world, port, check_finite=False):
    from megatron_refit.endpoint.receiver import Receiver
    from megatron_refit.endpoint.sender import Refitter
    from megatron_refit.transport import ProcessGroupTransport

    group = ProcessGroupTransport.connect(host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=TIMEOUT_S)
    kw = dict(num_train=NUM_TRAIN, num_gen=NUM_GEN, bucket_bytes=2048, verify="sampled")
    if rank < NUM_TRAIN:
        return Refitter(group, train_pieces(rank), check_finite=check_finite, **kw), None
    backend = gen_storage()
    return Receiver(group, backend, **kw), backend


def _order_rank(rank, world, port):
    """Refit 1 as usual; then the generation side calls prepare() again (it re-read its
    config) while the trainer refits 2; then both refit 3."""
    endpoint, backend = _endpoint(rank, world, port)
    endpoint.prepare()
    train = rank < NUM_TRAIN
    step = endpoint.refit if train else endpoint.receive
    out = [_outcome(lambda: step(1))]
    out.append(_outcome(lambda: step(2) if train else endpoint.prepare()))
    out.append(_outcome(lambda: step(3)))
    exact = None if train else holds_version(backend)
    return dict(outcome=out, exact=exact)


def test_ranks_in_different_calls_stop_on_every_rank_naming_both_calls():
    out = run_spawned(_order_rank, NUM_TRAIN + NUM_GEN, timeout_s=120)
    for rank, res in enumerate(out):
        first, mismatch, after = res["outcome"]
        assert first[0] == "ok" and after[0] == "ok", (rank, res)
        kind, msg, seconds = mismatch
        assert kind == "RefitProtocolError", (rank, mismatch)
        assert "refit rank(s) [0, 1] are in refit( version 2," in msg and "refit rank(s) [2, 3] are in prepare(" in msg
        assert seconds < TIMEOUT_S
    assert all(res["exact"] for res in out[NUM_TRAIN:])


def _nan_rank(rank, world, port):
    """With refit.check_finite, a NaN and an Inf on train rank 1 at refit 2 end that refit on
    every rank before any byte moves; the engine keeps version 1; refit 3 (finite) lands."""
    endpoint, backend = _endpoint(rank, world, port, check_finite=True)
    endpoint.prepare()
    train = rank < NUM_TRAIN
    step = endpoint.refit if train else endpoint.receive
    out = [_outcome(lambda: step(1))]
    if rank == 1:
        w = endpoint.pieces["layer3.w"].data
        saved = w.clone()
        w[0, 0], w[1, 2] = float("nan"), float("inf")
    out.append(_outcome(lambda: step(2)))
    state = None if train else (endpoint.state, endpoint.weights_version)
    if rank == 1:
        w.copy_(saved)
    out.append(_outcome(lambda: step(3)))
    exact = None if train else holds_version(backend)
    return dict(outcome=out, state=state, exact=exact)


def test_non_finite_trainer_weights_are_refused_before_any_byte_moves():
    out = run_spawned(_nan_rank, NUM_TRAIN + NUM_GEN, timeout_s=120)
    for rank, res in enumerate(out):
        first, nan, after = res["outcome"]
        assert first[0] == "ok" and after[0] == "ok", (rank, res)
        if rank == 1:
            assert nan[0] == "NonFiniteWeightsError", nan
            assert "layer3.w (1 NaN, 1 Inf)" in nan[1] and "refit rank 1" in nan[1] and "nothing was sent" in nan[1]
        else:
            assert nan[0] == "RefitAbortedError" and "refit rank(s) [1]" in nan[1], (rank, nan)
    for res in out[NUM_TRAIN:]:
        assert res["state"] == ("ready", 1) and res["exact"]


def _broken_rank(rank, world, port):
    """A generation rank stalls in refit 1; the others time out, and refit 2 then reports the
    group broken at once instead of waiting for another timeout."""
    on_write = stall_after(1, seconds=TIMEOUT_S + 1.5) if rank == NUM_TRAIN else None
    endpoint, backend = _endpoint(rank, world, port)
    endpoint.prepare()
    if backend is not None:
        backend.on_buffer = on_write
    step = endpoint.refit if rank < NUM_TRAIN else endpoint.receive
    out = [_outcome(lambda: step(1)), _outcome(lambda: step(2))]
    if rank == 0:
        time.sleep(2.0)  # rank 0 hosts the store where the first failure is recorded: stay up for the others
    return out


def test_a_timed_out_group_reports_itself_broken_until_reconnected():
    out = run_spawned(_broken_rank, NUM_TRAIN + NUM_GEN, timeout_s=120)
    firsts = {}
    for rank, (first, second) in enumerate(out):
        if first[0] == "ok" or rank == NUM_TRAIN:  # the stalled rank wakes long after its peers gave up
            continue
        assert first[0] in ("RefitTimeoutError", "RefitTransportError"), (rank, first)
        assert "at refit 1" in first[1] and first[2] <= TIMEOUT_S + 5, (rank, first)
        firsts[rank] = first[1]
        assert second[0] == "RefitTransportError" and second[2] < 1.0, (rank, second)
        assert "the refit group is broken" in second[1] and "at refit 1" in second[1] and "reconnect" in second[1]
    assert firsts and any(o[0][0] == "RefitTimeoutError" for o in out), out
    # every failed rank names the failure it saw, and those that were not first name the first one
    origins = {msg.split("; the first failure in the group: ")[-1].split(":")[0] for msg in firsts.values()}
    assert len(origins) == 1, firsts


def _join_rank(rank, world, port, scenario):
    from megatron_refit.transport import ProcessGroupTransport, RefitTransportError

    refit_rank, refit_world = rank, world
    if scenario == "duplicate" and rank == world - 1:
        refit_rank = world - 2  # two processes claim the same rank; the last rank never comes
        time.sleep(1.0)  # let the honest holder join first
    if scenario == "world" and rank == world - 1:
        refit_world = world + 1
    try:
        ProcessGroupTransport.connect(host="127.0.0.1", port=port, rank=refit_rank, world_size=refit_world,
                                      timeout_s=2.0)
    except RefitTransportError as exc:
        return str(exc)
    return "ok"


def test_a_duplicate_rank_is_named_at_connect():
    out = run_spawned(_join_rank, 4, "duplicate", timeout_s=60)
    assert "refit rank 2 joined the refit group" in out[3] and "twice" in out[3]
    for msg in out[:3]:
        assert "refit rank(s) [3] of 4 never joined" in msg and "refit rank(s) [2] joined twice" in msg, msg


def test_a_world_size_mismatch_is_named_at_connect():
    out = run_spawned(_join_rank, 4, "world", timeout_s=60)
    assert "refit rank 3 was started with world size 5; refit rank(s) [0] were started with world size(s) [4]" \
        in out[3], out[3]
    for msg in out[:3]:
        assert "refit rank(s) [3] were started with world size(s) [5]" in msg, msg


def test_the_store_listens_only_on_the_configured_address():
    import datetime

    from megatron_refit.local.launch import free_port
    from megatron_refit.transport.rendezvous import open_store

    port = free_port()
    store = open_store("127.0.0.1", port, rank=0, world_size=1, timeout=datetime.timedelta(seconds=5))
    store.set("k", "v")
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.split(":")[1], 16) == port:
                    listening.add(local.split(":")[0])
    assert listening == {"0100007F"}, listening  # 127.0.0.1 only, not 0.0.0.0 / ::
    assert store.get("k") == b"v"


def test_nonfinite_counts_reads_every_dtype_in_slices():
    from megatron_refit.endpoint.finite import nonfinite_counts

    w = torch.zeros(300, 7)
    w[299, 6], w[5, 0], w[100, 3] = float("nan"), float("-inf"), float("inf")
    assert nonfinite_counts(w, rows=64) == (1, 2)
    assert nonfinite_counts(w.to(torch.bfloat16)[:, 3]) == (0, 1)  # a strided 1-d view
    f8 = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    f8[1, 1] = float("nan")
    assert nonfinite_counts(f8) == (1, 0)
    assert nonfinite_counts(torch.arange(5)) == (0, 0) and nonfinite_counts(torch.tensor(float("nan"))) == (1, 0)


def _hf_cfg():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _hf_realloc_rank(rank, world, port):
    """The engine re-allocates its parameters after prepare() (offload / reload, model.to):
    refit 2 must land in the live model, not in the storage prepare() saw; a parameter
    that changed dtype is refused by name before any byte moves."""
    from megatron_refit.endpoint.receiver import Receiver
    from megatron_refit.endpoint.sender import Refitter, TensorPiece
    from megatron_refit.engines.hf.storage import HFStorage
    from megatron_refit.transport import ProcessGroupTransport

    group = ProcessGroupTransport.connect(host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=30)
    kw = dict(num_train=1, num_gen=1, bucket_bytes=1 << 14, verify="sampled")
    torch.manual_seed(0)
    recv = HFStorage.from_config(_hf_cfg())
    if rank == 0:  # the trainer's weights: another model of the same shape, changed per version
        pieces = [TensorPiece(spec, recv.buffer(spec.name).clone()) for spec in recv.target_specs()]
        endpoint = Refitter(group, pieces, **kw)
        endpoint.prepare()
        out = []
        for version in (1, 2, 3, 4):
            for piece in pieces:
                piece.data.add_(1.0)
            out.append(_outcome(lambda: endpoint.refit(version)))
        return dict(outcome=out, sent={p.spec.name: p.data for p in pieces})
    endpoint = Receiver(group, recv, **kw)
    endpoint.prepare()
    out = [_outcome(lambda: endpoint.receive(1))]
    for p in recv.model.parameters():  # re-allocated: the old storage is no longer the model's
        p.data = p.data.clone()
    out.append(_outcome(lambda: endpoint.receive(2)))
    live_after_2 = {n: t.clone() for n, t in recv.model.state_dict().items()}
    norm = recv.model.model.norm.weight
    norm.data = norm.data.double()
    out.append(_outcome(lambda: endpoint.receive(3)))
    state_3 = endpoint.state
    norm.data = norm.data.float()
    out.append(_outcome(lambda: endpoint.receive(4)))
    return dict(outcome=out, live_after_2=live_after_2, state_3=state_3, rebinds=recv.rebinds,
                live={n: t.clone() for n, t in recv.model.state_dict().items()})


def test_hf_receiver_follows_reallocated_parameters_and_refuses_changed_ones():
    train, gen = run_spawned(_hf_realloc_rank, 2, timeout_s=120)
    kinds = [o[0] for o in gen["outcome"]]
    assert kinds == ["ok", "ok", "ValueError", "ok"], gen["outcome"]
    assert [o[0] for o in train["outcome"]] == ["ok", "ok", "RefitAbortedError", "ok"]
    assert "model.norm.weight changed since prepare()" in gen["outcome"][2][1] and "torch.float64" in \
        gen["outcome"][2][1]
    assert gen["state_3"] == "stale" and gen["rebinds"] > 0
    # version 2 (trainer weights + 2) reached the live, re-allocated model; version 4 too
    assert torch.equal(gen["live_after_2"]["model.norm.weight"], train["sent"]["model.norm.weight"] - 2)
    assert all(torch.equal(gen["live"][n], t) for n, t in train["sent"].items() if n in gen["live"])


def test_a_broken_colocated_group_still_frees_its_shared_buffers():
    """close() is collective (peers unmap before the owner frees), but a broken group cannot
    meet: the owner frees its shared memory anyway instead of raising on the way out."""
    from multiprocessing import shared_memory

    from megatron_refit.transport.ipc import IpcTransport, _create
    from megatron_refit.transport import ProcessGroupTransport, RefitTransportError

    group = ProcessGroupTransport(object(), rank=0, world_size=2, backend="gloo", timeout_s=1.0)
    group.broken = "receive from rank 1 timed out after 1 s at refit 3"
    ipc = IpcTransport(group, num_train=1)
    ipc._own = [_create(64, torch.device("cpu"))]
    name = ipc._own[0].handle[1]
    ipc.close()
    assert ipc._own == []
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)
    with pytest.raises(RefitTransportError, match=r"the refit group is broken \(.*at refit 3\)"):
        group.barrier()
