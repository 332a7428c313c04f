"""Refitter/Receiver over gloo with plain-tensor pieces (no Megatron): dtypes that travel
as bytes, bucket windows, version and validation errors raised before any weight moves."""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_refit.endpoint.sender import TensorPiece
from megatron_refit.local.launch import SpawnError, run_spawned
from megatron_refit.plan.spec import ShardSpec, box_along, full_box

pytestmark = pytest.mark.slow

GLOBAL = {
    "w": ((8, 6), "float32"),
    "b": ((8, 6), "bfloat16"),
    "f8": ((4, 16), "float8_e4m3fn"),
    "n": ((6,), "float32"),
}


def _full(name):
    shape, dtype = GLOBAL[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    x = torch.randn(shape, generator=g)
    return x.to(getattr(torch, dtype))


class _Store:
    """A storage holding whole tensors."""

    def __init__(self, names, extra=()):
        self.t = {n: torch.zeros(GLOBAL[n][0], dtype=getattr(torch, GLOBAL[n][1])) for n in names}
        self.extra = list(extra)
        self.finalized = 0

    def target_specs(self):
        return [ShardSpec(name=n, global_shape=tuple(t.shape), dtype=GLOBAL[n][1], box=full_box(tuple(t.shape)))
                for n, t in self.t.items()] + self.extra

    def buffer(self, name):
        return self.t[name]

    def finalize(self):
        self.finalized += 1


def _rank(rank, world, port, mode, bucket_bytes, direct_bytes=None):
    from megatron_refit.endpoint.receiver import Receiver
    from megatron_refit.endpoint.sender import Refitter
    from megatron_refit.transport import ProcessGroupTransport

    group = ProcessGroupTransport.connect(host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=30)
    num_train = 2
    verify = "full" if mode == "colocated" else "sampled"
    if mode == "colocated":
        from megatron_refit.transport.ipc import IpcTransport

        group = IpcTransport(group, num_train=num_train)
    if rank < num_train:  # train TP2: dim-0 halves of every 2-D tensor, norms replicated
        pieces = []
        for name, (shape, dtype) in GLOBAL.items():
            full = _full(name)
            if len(shape) == 1:
                spec = ShardSpec(name=name, global_shape=shape, dtype=dtype, box=full_box(shape))
                pieces.append(TensorPiece(spec, full))
            else:
                half = shape[0] // 2
                box = box_along(shape, 0, rank * half, (rank + 1) * half)
                pieces.append(TensorPiece(ShardSpec(name=name, global_shape=shape, dtype=dtype, box=box),
                                     full[rank * half:(rank + 1) * half]))
        seen = []
        ep = Refitter(group, pieces, num_train=num_train, num_gen=world - num_train, bucket_bytes=bucket_bytes,
                      direct_bytes=direct_bytes, verify=verify, on_report=seen.append)
        ep.prepare()
        reports = [ep.refit(v) for v in (1, 2)]
        if mode == "backwards":
            ep.refit(1)
        shared = getattr(group, "bytes_shared", 0)
        if mode == "colocated":
            group.close()  # collective: every rank is done reading before buffers go away
        assert seen == [r.summary for r in reports] and seen[0]  # the callback got every refit's group metrics
        return [dict(r.as_dict(), shared=shared) for r in reports]
    extra = []
    if mode == "unknown-name":
        extra = [ShardSpec(name="not.in.trainer", global_shape=(2,), dtype="float32", box=((0, 2),))]
    store = _Store(GLOBAL, extra)
    ep = Receiver(group, store, num_train=num_train, num_gen=world - num_train, bucket_bytes=bucket_bytes,
                  direct_bytes=direct_bytes, verify=verify)
    ep.prepare()
    reports = [ep.receive(v) for v in (1, 2)]
    if mode == "backwards":
        ep.receive(1)
    exact = all(torch.equal(store.t[n].view(torch.uint8), _full(n).view(torch.uint8)) for n in GLOBAL)
    shared = getattr(group, "bytes_shared", 0)
    if mode == "colocated":
        group.close()  # collective: every rank is done reading before buffers go away
    return dict(exact=exact, finalized=store.finalized, reports=[r.as_dict() for r in reports], shared=shared)


@pytest.mark.parametrize(
    "bucket_bytes,direct_bytes",
    [(16, None), (100, None), (1 << 20, None), (1 << 20, 32), (64, 32)],
    ids=["tiny-buckets", "small", "one-bucket", "direct", "direct-chunked"],
)
def test_refit_moves_every_dtype_exactly(bucket_bytes, direct_bytes):
    """``direct``: transfers of >= 32 bytes go straight from the local tensor into the
    receiver's storage (no packing); ``direct-chunked`` also splits them into 64-byte chunks."""
    out = run_spawned(_rank, 4, "ok", bucket_bytes, direct_bytes, timeout_s=120)
    for gen in out[2:]:
        assert gen["exact"] and gen["finalized"] == 2
        for report in gen["reports"]:
            assert report["bytes_received"] == report["bytes_minimal"] // 2
            paths = report["paths"]
            assert paths["direct"] + paths["packed"] > 0 and paths["shared"] == 0
            assert paths["direct"] > 0 or direct_bytes is None
    sent = sum(r["bytes_sent"] for train in out[:2] for r in train[:1])
    assert sent == out[0][0]["bytes_minimal"]
    # replicated norm: the two train ranks share the load
    assert out[0][0]["bytes_sent"] > 0 and out[1][0]["bytes_sent"] > 0
    # every rank holds the same flat group summary of each refit, reduced from all four
    for i in (0, 1):
        summaries = [out[r][i]["summary"] for r in (0, 1)] + [out[r]["reports"][i]["summary"] for r in (2, 3)]
        assert all(s == summaries[0] for s in summaries)
        s = summaries[0]
        assert s["refit/version"] == i + 1 and s["refit/ok"] == 1 and s["refit/failed_ranks"] == 0
        assert s["refit/bytes"] == sent == s["refit/bytes_minimal"]
        assert s["refit/train_ranks"] == s["refit/gen_ranks"] == 2
        assert s["refit/buckets"] == sum(sum(out[r][i]["paths"].values()) for r in (0, 1))
        totals = [out[r][i]["seconds"]["total"] for r in (0, 1)] + \
            [out[r]["reports"][i]["seconds"]["total"] for r in (2, 3)]
        assert s["refit/total_s"] == pytest.approx(max(totals), abs=1e-6)
        # the ranks exchange whole microseconds: of ranks tied at that resolution, the first is named
        assert totals[s["refit/slowest_rank"]] == pytest.approx(max(totals), abs=1e-6)
        assert s["refit/gbps"] == pytest.approx(sent / s["refit/total_s"] / 1e9)
        assert all(isinstance(v, (int, float)) for v in s.values())


def test_unknown_receiver_name_fails_on_every_rank_before_transfer():
    with pytest.raises(SpawnError, match="not.in.trainer"):
        run_spawned(_rank, 4, "unknown-name", 1 << 20, timeout_s=120)


def test_version_going_backwards_is_refused():
    with pytest.raises(SpawnError, match="version 1 does not advance past 2"):
        run_spawned(_rank, 4, "backwards", 1 << 20, timeout_s=120)


def test_colocated_refit_through_shared_buffers():
    """Colocated mode: bucket bytes only through shared-memory staging buffers (checksummed),
    control messages over gloo; bit-exact, every payload byte accounted for."""
    out = run_spawned(_rank, 4, "colocated", 100, 32, timeout_s=120)
    for gen in out[2:]:
        assert gen["exact"] and gen["finalized"] == 2
        assert gen["shared"] >= sum(r["bytes_received"] for r in gen["reports"]) > 0
        assert all(r["paths"]["shared"] > 0 and r["paths"]["direct"] == r["paths"]["packed"] == 0
                   for r in gen["reports"])
    sent = sum(r["bytes_sent"] for train in out[:2] for r in train[:1])
    assert sent == out[0][0]["bytes_minimal"]
    assert all(train[-1]["shared"] > 0 for train in out[:2])


def _unique_rank(rank, world, port):
    from megatron_refit.transport import ProcessGroupTransport

    group = ProcessGroupTransport.connect(host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=30)
    objs = [{"role": "a", "n": list(range(1000))}, {"role": "a", "n": list(range(1000))}, ("b", rank), None]
    got, digests = group.all_gather_unique(objs[rank], digests=True)
    # a rejoin: what this rank decoded before is taken by its digest, not decoded again
    known = {digests[2]: "decoded before"} if rank != 2 else {}
    again = group.all_gather_unique(objs[rank], known=known)
    # equal objects come back as one object; every rank gets what each rank gave
    return dict(equal=got == [objs[0], objs[0], ("b", 2), None], shared=got[0] is got[1], distinct=got[2] is not got[0],
                known=again[2] == ("decoded before" if rank != 2 else ("b", 2)) and again[:2] == got[:2])


@pytest.mark.slow
def test_all_gather_unique_moves_each_distinct_object_once():
    out = run_spawned(_unique_rank, 4, timeout_s=60)
    assert all(r == dict(equal=True, shared=True, distinct=True, known=True) for r in out), out


class _Failing(_Store):
    """A storage whose pre-refit check fails when told to (an engine whose storage
    changed shape since prepare())."""

    fail = False

    def refresh_targets(self):
        if self.fail:
            raise ValueError("engine parameter w changed shape")


def _agreement_rank(rank, world, port):
    """Per-refit agreement: a refit where train and generation ranks use different plans, one
    where a generation rank's own check fails, then a good one on the same group."""
    from megatron_refit.endpoint.receiver import Receiver
    from megatron_refit.endpoint.sender import Refitter
    from megatron_refit.transport import ProcessGroupTransport

    group = ProcessGroupTransport.connect(host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=30)
    kw = dict(num_train=2, num_gen=2, bucket_bytes=1 << 20)
    if rank < 2:
        pieces = {n: TensorPiece(ShardSpec(name=n, global_shape=GLOBAL[n][0], dtype=GLOBAL[n][1],
                                           box=full_box(GLOBAL[n][0])), _full(n)) for n in GLOBAL}
        full, sub = Refitter(group, list(pieces.values()), **kw), Refitter(group, [pieces["n"]], **kw)
        call = lambda ep, v: ep.refit(v)  # noqa: E731
    else:
        store = _Failing(GLOBAL)
        sub_store = _Failing(["n"])
        full, sub = Receiver(group, store, **kw), Receiver(group, sub_store, **kw)
        call = lambda ep, v: ep.receive(v)  # noqa: E731
    full.prepare()
    sub.prepare()
    out = {}
    for version, endpoint in ((1, full), (2, sub if rank >= 2 else full), (3, full), (4, full)):
        if rank == 3:
            store.fail = version == 3
        try:
            call(endpoint, version)
            out[version] = "ok"
        except Exception as exc:  # noqa: BLE001 -- the test reads each rank's error
            out[version] = f"{type(exc).__name__}: {exc}"
    if rank >= 2:
        out["exact"] = all(torch.equal(store.t[n].view(torch.uint8), _full(n).view(torch.uint8)) for n in GLOBAL)
        out["state"] = full.state
    return out


def test_refit_calls_that_disagree_end_on_every_rank_and_the_group_recovers():
    out = run_spawned(_agreement_rank, 4, timeout_s=120)
    assert all(r[1] == "ok" and r[4] == "ok" for r in out), out
    assert all("refit ranks use different plans (ranks by plan:" in r[2] for r in out), [r[2] for r in out]
    assert out[3][3] == "ValueError: engine parameter w changed shape"
    assert all(r[3].startswith("RefitAbortedError: refit 3: refit rank(s) [3] failed their checks")
               for r in out[:3]), [r[3] for r in out]
    assert all(r["exact"] and r["state"] == "ready" for r in out[2:])
