"""Runs: whole pieces that lie back to back in memory on both ends of a transfer (gate and
up of one fused weight, q/k/v of one split) share one bucket that goes direct, without
packing, where each side's memory allows; each side checks its own memory at every refit
and packs or unpacks through staging where it does not."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.endpoint.sender import TensorPiece
from megatron_refit.endpoint.direct import adjacent_pieces
from megatron_refit.local.launch import run_spawned
from megatron_refit.plan.refit_plan import RefitPlan
from megatron_refit.errors import PlanError
from megatron_refit.plan.spec import ShardSpec, box_along, full_box

SHAPE = (8, 4)  # float32: a half is 4 rows = 64 bytes, a multiple of ALIGN


def _spec(name, box=None, shape=SHAPE):
    return ShardSpec(name=name, global_shape=shape, dtype="float32", box=box or full_box(shape))


def _plan(src_adj, dst_adj, *, bucket_bytes=1 << 20, direct_bytes=32, names=("gate", "up", "down")):
    train = {0: [_spec(n) for n in names]}
    gen = {0: [_spec(n) for n in names]}
    return RefitPlan.build(train, gen, bucket_bytes=bucket_bytes, direct_bytes=direct_bytes,
                           train_adjacent={0: src_adj}, gen_adjacent={0: dst_adj})


def _layout(plan):
    return [[(item.transfer.name, item.offset) for item in b.items] for b in plan.buckets]


def test_adjacent_on_both_ends_share_one_bucket_back_to_back():
    plan = _plan([("gate", "up")], [("gate", "up")])
    assert _layout(plan) == [[("down", 0)], [("gate", 0), ("up", 128)]]


@pytest.mark.parametrize("src,dst", [([("gate", "up")], []), ([], [("gate", "up")]),
                                     ([("gate", "up")], [("up", "gate")])])
def test_adjacent_on_one_end_only_stays_apart(src, dst):
    assert _layout(_plan(src, dst)) == [[("down", 0)], [("gate", 0)], [("up", 0)]]


def test_run_is_cut_at_the_bucket_size_and_needs_direct_transfers():
    chain = [("down", "gate"), ("gate", "up")]
    assert _layout(_plan(chain, chain)) == [[("down", 0), ("gate", 128), ("up", 256)]]
    assert _layout(_plan(chain, chain, bucket_bytes=256)) == [[("down", 0), ("gate", 128)], [("up", 0)]]
    # below direct_bytes nothing is a run: all three fill one packed bucket
    assert _layout(_plan(chain, chain, direct_bytes=1024)) == [[("down", 0), ("gate", 128), ("up", 256)]]
    assert len(_plan(chain, chain, direct_bytes=None).buckets) == 1


def test_a_cycle_in_the_hints_loses_no_transfer():
    cycle = [("gate", "up"), ("up", "gate")]
    plan = _plan(cycle, cycle)
    assert sorted(item.transfer.name for b in plan.buckets for item in b.items) == ["down", "gate", "up"]


def test_small_transfers_fill_one_bucket_across_large_ones():
    names = ("a.big", "a.norm", "b.big", "b.norm")
    specs = [_spec(n, shape=(64, 4) if n.endswith("big") else (4,)) for n in names]
    plan = RefitPlan.build({0: specs}, {0: specs}, bucket_bytes=1 << 20, direct_bytes=512)
    assert [[i.transfer.name for i in b.items] for b in plan.buckets] == [["a.big"], ["b.big"], ["a.norm", "b.norm"]]


def test_open_bucket_closes_after_a_bucket_of_direct_bytes_went_past():
    """Small items must not wait for the whole model: their sources (e.g. k and v of a QKV
    split whose q already left) stay alive until their bucket is sent."""
    names = [f"{layer}.{kind}" for layer in range(4) for kind in ("big", "norm")]
    specs = [_spec(n, shape=(64, 4) if n.endswith("big") else (4,)) for n in names]  # big: 1024 bytes
    plan = RefitPlan.build({0: specs}, {0: specs}, bucket_bytes=2048, direct_bytes=512)
    assert [[i.transfer.name for i in b.items] for b in plan.buckets] == [
        ["0.big"], ["1.big"], ["2.big"], ["0.norm", "1.norm"], ["3.big"], ["2.norm", "3.norm"]]


def test_partial_pieces_are_not_runs():
    """Train holds the whole tensors, the gen rank a half of each: the transfers cover only
    part of the sender's pieces, whose halves are not back to back in its memory."""
    train = {0: [_spec("gate"), _spec("up")]}
    gen = {0: [_spec("gate", box_along(SHAPE, 0, 0, 4)), _spec("up", box_along(SHAPE, 0, 0, 4))]}
    plan = RefitPlan.build(train, gen, bucket_bytes=1 << 20, direct_bytes=32,
                           train_adjacent={0: [("gate", "up")]}, gen_adjacent={0: [("gate", "up")]})
    assert [len(b.items) for b in plan.buckets] == [1, 1]


def test_hint_naming_a_piece_the_rank_lacks_is_refused():
    with pytest.raises(PlanError, match=r"train_adjacent of train rank 0: \('gate', 'nope'\)"):
        _plan([("gate", "nope")], [])


def test_adjacent_pieces_reads_memory():
    fused = torch.zeros(8, 4)
    other = torch.zeros(4, 4)
    got = adjacent_pieces({"gate": fused[:4], "up": fused[4:], "x": other, "col": fused[:, :2]})
    assert got == [("gate", "up")]


def _fused_halves(rank):
    g = torch.Generator().manual_seed(7)
    gate, up = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    return gate, up, torch.cat([gate[4 * rank:4 * rank + 4], up[4 * rank:4 * rank + 4]])


class _Fused:
    """A gen TP rank holding [gate_half; up_half] in one tensor (vLLM's gate_up_proj), or
    in two tensors when ``fused`` is False."""

    def __init__(self, rank, fused):
        self.rank = rank
        self.store = torch.zeros(8, 4)
        self.t = {"gate": self.store[:4], "up": self.store[4:]} if fused else \
            {"gate": torch.zeros(4, 4), "up": torch.zeros(4, 4)}

    def target_specs(self):
        return [_spec(n, box_along(SHAPE, 0, 4 * self.rank, 4 * self.rank + 4)) for n in ("gate", "up")]

    def buffer(self, name):
        return self.t[name]

    def finalize(self):
        pass


def _rank(rank, world, port, sender_fused, receiver_fused):
    from megatron_refit.endpoint.receiver import Receiver
    from megatron_refit.endpoint.sender import Refitter
    from megatron_refit.transport import ProcessGroupTransport

    group = ProcessGroupTransport.connect(host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=30)
    kw = dict(num_train=2, num_gen=2, bucket_bytes=1 << 20, direct_bytes=32)
    if rank < 2:
        _, _, fused = _fused_halves(rank)
        gate, up = (fused[:4], fused[4:]) if sender_fused else (fused[:4].clone(), fused[4:].clone())
        pieces = [TensorPiece(_spec("gate", box_along(SHAPE, 0, 4 * rank, 4 * rank + 4)), gate),
                  TensorPiece(_spec("up", box_along(SHAPE, 0, 4 * rank, 4 * rank + 4)), up, follows="gate")]
        ep = Refitter(group, pieces, **kw)
        plan = ep.prepare()
        return dict(items=[len(b.items) for b in plan.buckets_from(rank)], paths=dict(ep.refit(1).paths))
    backend = _Fused(rank - 2, receiver_fused)
    ep = Receiver(group, backend, **kw)
    ep.prepare()
    paths = dict(ep.receive(1).paths)
    _, _, want = _fused_halves(rank - 2)
    got = torch.cat([backend.t["gate"], backend.t["up"]])
    return dict(exact=torch.equal(got.view(torch.uint8), want.view(torch.uint8)), paths=paths)


@pytest.mark.slow
@pytest.mark.parametrize("sender_fused,receiver_fused,items,sender_path,receiver_path", [
    (True, True, [2], "direct", "direct"),
    (False, True, [2], "packed", "direct"),  # the hint was wrong at refit time: the sender packs
    (True, False, [1, 1], "direct", "direct"),  # receiver not fused: no run, two direct buckets
], ids=["both-fused", "sender-not-adjacent", "receiver-separate"])
def test_run_moves_bit_exact_whatever_each_side_memory(sender_fused, receiver_fused, items, sender_path,
                                                        receiver_path):
    out = run_spawned(_rank, 4, sender_fused, receiver_fused, timeout_s=120)
    for train in out[:2]:
        assert train["items"] == items
        assert train["paths"][sender_path] == len(items) and sum(train["paths"].values()) == len(items)
    for gen in out[2:]:
        assert gen["exact"]
        assert gen["paths"][receiver_path] == len(items)


def test_gpu_checks_refuse_without_a_gpu_in_one_line_and_exit_2():
    """``make gpu-check`` (scripts/gpu_checks.py) on a machine without a GPU: one line, exit 2,
    nothing run, nothing written; a check it does not know is refused by argparse."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: make gpu-check would run")
    root = Path(__file__).resolve().parents[2]
    script = [sys.executable, str(root / "scripts" / "gpu_checks.py")]
    run = subprocess.run(script, capture_output=True, text=True, timeout=120, cwd=root)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [
        "error: make gpu-check needs an NVIDIA GPU, and torch sees none here (torch.cuda.is_available() is False); "
        "the CPU suite is make test"]
    bad = subprocess.run([*script, "--only", "fp9"], capture_output=True, text=True, timeout=120, cwd=root)
    assert bad.returncode == 2 and "invalid choice: 'fp9'" in bad.stderr


def test_gpu_checks_table_and_verdicts():
    """The one table ``make gpu-check`` prints, and when the checks without an ``ok`` of their
    own pass (what a GPU run records: tested here on recorded-shape results)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu_checks.py"
    spec = importlib.util.spec_from_file_location("gpu_checks", path)
    gpu_checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_checks)
    assert gpu_checks.VERDICTS["fp8"](dict(bit_exact=True)) and not gpu_checks.VERDICTS["fp8"](dict(bit_exact=False))
    assert not gpu_checks.VERDICTS["colocated"]({"a": dict(ok=True), "b": dict(ok=False, error="x")})
    assert gpu_checks.VERDICTS["nccl_one_gpu"](dict(accepted=False, error="refused"))
    text = gpu_checks.table([dict(check="fp8", seconds=3.2, result=dict(ok=True)),
                             dict(check="vllm", seconds=0.0, result=dict(ok=None, skipped="no .venv-vllm")),
                             dict(check="colocated", seconds=9.0, result=dict(ok=False, error="Traceback\nBoom"))])
    assert text.splitlines()[1:] == ["fp8                ok            3.2  ",
                                     "vllm               skipped       0.0  no .venv-vllm",
                                     "colocated          FAILED        9.0  Boom"]
