"""The compact form ``prepare()`` gathers (megatron_refit.plan.pieces): pieces through the
wire and back, the plan built from it equal to the plan built from ShardSpecs (adjacency
hints included), and a peer's malformed parts refused naming the rank. Equality with the
receivers' ShardSpecs on reduced shipped layouts is tests/unit/test_assignment.py's."""

from __future__ import annotations

from array import array

import pytest

from megatron_refit import wire
from megatron_refit.errors import PlanError
from megatron_refit.plan.gen_layout import GenLayout, ModelShape, gen_target_specs
from megatron_refit.plan.pieces import adjacent_names, gen_targets_of, pack, unpack
from megatron_refit.plan.refit_plan import RefitPlan, build_local_plan
from megatron_refit.plan.spec import ShardSpec, box_along, full_box

MODEL = ModelShape(num_attention_heads=4, num_kv_heads=2, vocab_size=100)
PARAMS = {
    "model.embed_tokens.weight": ((100, 8), "bfloat16"),
    "model.layers.0.self_attn.q_proj.weight": ((8, 8), "bfloat16"),
    "model.layers.0.mlp.gate_proj.weight": ((16, 8), "bfloat16"),
    "model.layers.0.mlp.up_proj.weight": ((16, 8), "bfloat16"),
    "model.layers.0.mlp.down_proj.weight": ((8, 16), "bfloat16"),
    "model.norm.weight": ((8,), "float32"),
}
GATE, UP = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"


def _train() -> dict[int, list[ShardSpec]]:
    """Two train ranks: column halves of the MLP weights, the rest whole on rank 0."""
    out = {0: [], 1: []}
    for name, (shape, dtype) in PARAMS.items():
        if "mlp" in name:
            dim = 1 if "down" in name else 0
            half = shape[dim] // 2
            for rank in (0, 1):
                out[rank].append(ShardSpec(name, shape, dtype, box_along(shape, dim, rank * half, (rank + 1) * half)))
        else:
            out[0].append(ShardSpec(name, shape, dtype, full_box(shape)))
    return out


def _roundtrip(obj):
    return wire.loads(wire.dumps(obj))


def test_pieces_travel_as_plain_data_and_unpack_to_the_same_specs():
    specs = _train()[0]
    names, layout = pack(specs, [(GATE, UP)])
    assert names[0] == tuple(sorted(s.name for s in specs)) and adjacent_names(names) == {GATE: UP}
    names, layout = _roundtrip(names), _roundtrip(layout)
    assert unpack("train", 0, names, layout) == sorted(specs, key=lambda s: s.name)
    assert adjacent_names(names) == {GATE: UP}


@pytest.mark.parametrize("direct", [None, 64])
def test_plan_from_gathered_pieces_equals_plan_from_specs(direct):
    train = _train()
    gen = gen_target_specs(PARAMS, GenLayout(tp=2, dp=2), MODEL)
    train_adj = {0: [(GATE, UP)], 1: [(GATE, UP)]}
    gen_adj = {rank: [(GATE, UP)] for rank in gen}
    whole = RefitPlan.build(train, gen, bucket_bytes=4096, direct_bytes=direct, train_adjacent=train_adj,
                            gen_adjacent=gen_adj)
    parts = [_roundtrip(pack(train[r], train_adj[r])) for r in train]
    parts += [_roundtrip(pack(gen[r], gen_adj[r])) for r in gen]
    for local in [("train", 0), ("train", 1), ("gen", 0), ("gen", 3)]:
        plan = build_local_plan(parts, len(train), bucket_bytes=4096, direct_bytes=direct, local=local)
        if local[0] == "train":
            assert plan.buckets_from(local[1]) == whole.buckets_from(local[1])
        else:
            assert plan.buckets_to(local[1]) == whole.buckets_to(local[1])
            assert plan.gen_pieces(local[1]) == sorted(gen[local[1]], key=lambda s: s.name)
        assert plan.fingerprints()["plan"] == whole.fingerprints()["plan"]
    if direct is not None:  # gate and up adjacent on both ends, whole: one direct bucket of two items
        runs = [b for b in whole.buckets if [i.transfer.name for i in b.items] == [GATE, UP]]
        assert runs and all(b.nbytes == b.payload_bytes for b in runs)


def test_a_trainer_parameter_no_gen_rank_holds_is_refused():
    train = _train()
    gen = gen_target_specs({k: v for k, v in PARAMS.items() if k != "model.norm.weight"}, GenLayout(tp=1), MODEL)
    parts = [pack(train[0]), pack(train[1]), pack(gen[0])]
    with pytest.raises(ValueError, match=r"the trainer produces 1 HF parameters that no generation rank holds .*"
                                         r"model\.norm\.weight"):
        build_local_plan(parts, 2, bucket_bytes=4096, direct_bytes=None, local=("gen", 0))


def test_optional_pieces_no_gen_rank_holds_are_skipped_by_name_and_only_they():
    """MTP layers: the train ranks mark them optional; where no engine rank holds them the plan
    skips them (counted), where one does it sends them, and any other unheld piece is refused."""
    train = _train()
    held = {k: v for k, v in PARAMS.items() if k != "model.norm.weight"}
    parts = [pack(train[0]), pack(train[1]), pack(gen_target_specs(held, GenLayout(tp=1), MODEL)[0])]
    plan = build_local_plan(parts, 2, bucket_bytes=4096, direct_bytes=None, local=("gen", 0),
                            optional=frozenset({"model.norm.weight"}))
    assert plan.skipped_params == ("model.norm.weight",) and plan.summary()["num_skipped_params"] == 1
    assert "model.norm.weight" not in {t.name for t in plan.transfers}
    everything = [pack(train[0]), pack(train[1]), pack(gen_target_specs(PARAMS, GenLayout(tp=1), MODEL)[0])]
    sent = build_local_plan(everything, 2, bucket_bytes=4096, direct_bytes=None, local=("gen", 0),
                            optional=frozenset({"model.norm.weight"}))
    assert sent.skipped_params == () and "model.norm.weight" in {t.name for t in sent.transfers}
    fewer = {k: v for k, v in held.items() if k != "model.layers.0.self_attn.q_proj.weight"}
    parts[2] = pack(gen_target_specs(fewer, GenLayout(tp=1), MODEL)[0])
    with pytest.raises(ValueError, match=r"produces 1 HF parameters that no generation rank holds .*q_proj.*; 1 MTP "
                                         r"parameters besides, which may be skipped"):
        build_local_plan(parts, 2, bucket_bytes=4096, direct_bytes=None, local=("gen", 0),
                         optional=frozenset({"model.norm.weight"}))


def _gen_parts():
    return {rank: pack(specs) for rank, specs in gen_target_specs(PARAMS, GenLayout(tp=2), MODEL).items()}


def test_ranks_sharing_names_but_numbering_kinds_otherwise_plan_alike():
    """An engine's TP ranks share one names list; their kinds are read once where they number
    them alike, per rank where they do not (here rank 1 lists its kinds in reverse)."""
    from array import array

    from megatron_refit.plan.pieces import widen

    parts = _gen_parts()
    (names, pairs), (kinds, raw) = parts[1]
    names = parts[0][0][0]  # one names list, as the gather returns it
    parts[0] = ((names, pairs), parts[0][1])
    want = gen_targets_of(dict(parts))
    parts[1] = ((names, pairs), (kinds, raw))
    assert gen_targets_of(dict(parts)) == want
    reverse = array("I", (len(kinds) - 1 - k for k in widen(raw, len(names))))  # 4 bytes each: read as well
    parts[1] = ((names, pairs), (kinds[::-1], reverse.tobytes()))
    got = gen_targets_of(dict(parts))
    assert got == want and len(got.ranks) == 2
    assert got.params[GATE][2] == (((0, 8), (0, 8)), ((8, 16), (0, 8)))  # each rank its own half


def _broken(rank: int, how: str) -> dict:
    parts = _gen_parts()
    (names, pairs), (kinds, raw) = parts[rank]
    if how == "index":
        raw = raw[:-4] + (len(kinds)).to_bytes(4, "little")
    elif how == "count":  # one kind index short (each in one byte: narrow)
        raw = raw[:-1]
    elif how == "box":
        shape, dtype, box, stage, expert = kinds[0]
        kinds = ((shape, dtype, ((0, shape[0] + 1),) + box[1:], stage, expert),) + kinds[1:]
    elif how == "pair":
        pairs = (0, len(names))
    elif how == "twice":
        names = (names[0],) + names[:-1]
    elif how == "kind":
        kinds = ((8, "bf16"),) + kinds[1:]
    elif how == "name":
        names = names[:-1] + (7,)
    elif how == "type":
        kinds = list(kinds)
    elif how == "shape":
        shape, dtype, box, stage, expert = kinds[0]
        kinds = ((tuple(n * 2 for n in shape), dtype, box, stage, expert),) + kinds[1:]
    parts[rank] = ((names, pairs), (kinds, raw))
    return parts


@pytest.mark.parametrize("how, match", [
    ("index", r"gen rank 1: kind index (\d+) out of range for \1 kinds"),
    ("count", r"gen rank 1: 6 names but 5 bytes of kind indices"),
    ("box", r"gen rank 1: malformed piece kind .*outside global shape"),
    ("kind", r"gen rank 1: malformed piece kind \(8, 'bf16'\): expected \(global shape, dtype, box, pp stage"),
    ("name", r"gen rank 1: a piece name is 7, not a string"),
    ("pair", r"gen_adjacent of gen rank 1: a pair names a piece the rank does not hold \(index 6 of 6\)"),
    ("type", r"gen rank 1: malformed pieces \(expected \(\(names, pairs\), \(kinds, bytes\)\) of tuples\)"),
    ("twice", r"model\.embed_tokens\.weight: listed twice on gen rank 1"),
    ("shape", r"model\.embed_tokens\.weight: global shape \(100, 8\) dtype bfloat16 on gen rank 0, \(200, 16\)"),
])
@pytest.mark.reliability
def test_malformed_pieces_from_a_peer_are_refused_naming_it(how, match):
    with pytest.raises(PlanError, match=match):
        gen_targets_of(_broken(1, how))


def _replicated_parts() -> dict[int, tuple]:
    """Four train ranks: DP replicas 0, 2 and 1, 3 each share one part object, as the gather returns them."""
    train = _train()
    first, second = pack(train[0]), pack(train[1])
    return {0: first, 1: second, 2: first, 3: second}


def test_index_of_gathered_parts_equals_the_index_of_their_specs():
    from megatron_refit.plan.checks import index_specs
    from megatron_refit.plan.pieces import index_parts

    parts = _replicated_parts()
    index, meta = index_parts("train", parts)
    specs = {rank: unpack("train", rank, *part) for rank, part in parts.items()}
    want_index, want_meta = index_specs("train", specs)
    assert {name: dict(boxes) for name, boxes in want_index.items()} == index  # holders in rank order
    assert index["model.norm.weight"] == {((0, 8),): [0, 2]}
    assert {name: (s.global_shape, s.dtype) for name, s in want_meta.items()} == \
        {name: (s.global_shape, s.dtype) for name, s in meta.items()}


@pytest.mark.parametrize("how, match", [
    ("twice", r"model\.embed_tokens\.weight: listed twice on train rank 1"),
    ("name", r"train rank 1: a piece name is 7, not a string"),
    ("shape", r"train pieces disagree: global shape \(100, 8\) bfloat16 vs \(200, 16\) bfloat16 on train rank 1"),
])
@pytest.mark.reliability
def test_malformed_train_parts_are_refused_naming_the_rank(how, match):
    from megatron_refit.plan.pieces import index_parts

    parts = _broken(1, how)  # gen parts of two ranks, the second broken: as train parts here
    with pytest.raises(PlanError, match=match):
        index_parts("train", parts)


@pytest.mark.parametrize("top, width", [(0, 1), (255, 1), (256, 2), ((1 << 16) - 1, 2), (1 << 16, 4)])
def test_kind_indices_travel_in_the_fewest_bytes_that_hold_the_largest(top, width):
    """A rank's tens of thousands of kind indices of a few dozen kinds: one byte each on the
    wire (pack, pack_targets, fold); read back at any width from the sizes alone."""
    from megatron_refit.plan.pieces import narrow, widen

    values = [0, top, top // 2, 1 if top else 0]
    raw = narrow(values)
    assert len(raw) == width * len(values)
    assert list(widen(raw, len(values))) == values
    assert list(widen(array("I", values).tobytes(), len(values))) == values  # 4 bytes each: read as well
    assert widen(raw + b"\0", len(values)) is None and widen(raw, len(values) + 1) is None
    assert list(widen(b"", 0)) == [] and widen(b"\0", 0) is None
    assert widen(b"\0" * 3 * len(values), len(values)) is None  # no 3-byte width


def test_an_engine_ranks_part_carries_one_byte_a_name():
    parts = _gen_parts()
    (names, _), (kinds, raw) = parts[0]
    assert len(kinds) < 256 and len(raw) == len(names)
    assert gen_targets_of(dict(parts)).params  # and plans


def test_names_of_one_part_and_kind_share_boxes_until_another_part_adds_to_one():
    """index_parts gives a part's names of one kind one boxes dict (the assignment and the
    tiling check take them once by its identity); where another part adds a box or a holder
    to one of them, that name's dict is its own copy and its siblings keep theirs unchanged.
    The assignment equals the one from index_specs' dict per name."""
    from megatron_refit.plan.assignment import Assignment
    from megatron_refit.plan.checks import index_specs
    from megatron_refit.plan.pieces import index_parts

    def half(name, lo):
        return ShardSpec(name, (8, 4), "bfloat16", ((lo, lo + 4), (0, 4)))

    names = ("a", "b", "c", "d")
    parts = {0: pack([half(n, 0) for n in names]), 1: pack([half("a", 4), half("b", 4), half("c", 4),
                                                             half("d", 4)]),
             2: pack([half("b", 0)])}  # b's first half held twice, a's and c's as split
    index, meta = index_parts("train", parts)
    want, want_meta = index_specs("train", {rank: unpack("train", rank, *part) for rank, part in parts.items()})
    assert {name: dict(boxes) for name, boxes in want.items()} == index
    assert index["a"] is not index["b"] and index["a"] is not index["c"]  # each merged: its own copy
    assert index["b"] == {((0, 4), (0, 4)): [0, 2], ((4, 8), (0, 4)): [1]}
    lone = index_parts("train", {0: pack([half(n, 0) for n in names])})[0]
    assert lone["a"] is lone["b"] is lone["c"] is lone["d"] == {((0, 4), (0, 4)): [0]}  # shared while unmerged
    targets = gen_targets_of({0: pack([ShardSpec(n, (8, 4), "bfloat16", full_box((8, 4))) for n in names])})
    assert Assignment.from_index(index, meta, 3, targets) == Assignment.from_index(want, want_meta, 3, targets)
    with pytest.raises(PlanError, match=r"^a: train pieces cover 16 elements"):  # the shared dict checked by name
        Assignment.from_index(lone, index_parts("train", {0: pack([half(n, 0) for n in names])})[1], 1, targets)


def test_holders_merged_across_parts_are_copies_in_rank_order_and_the_index_stays_as_built():
    """index_parts shares one holders list among a part's names and copies it where another
    part holds the name too (its lists are read only); building the assignment from the index
    leaves it as it was, and twice gives the same assignment."""
    import copy

    from megatron_refit.plan.assignment import Assignment
    from megatron_refit.plan.checks import index_specs
    from megatron_refit.plan.pieces import index_parts

    def spec(name):
        return ShardSpec(name, (8,), "bfloat16", full_box((8,)))

    shared = pack([spec("model.norm.weight"), spec("x0")])
    parts = {0: shared, 1: pack([spec("model.norm.weight"), spec("x1")]),
             2: pack([spec("model.norm.weight"), spec("x0"), spec("x2")]), 3: shared}
    index, meta = index_parts("train", parts)
    want, _ = index_specs("train", {rank: unpack("train", rank, *part) for rank, part in parts.items()})
    assert {name: dict(boxes) for name, boxes in want.items()} == index
    assert index["model.norm.weight"] == {((0, 8),): [0, 1, 2, 3]} and index["x0"] == {((0, 8),): [0, 2, 3]}
    assert index["x1"] == {((0, 8),): [1]} and index["x2"] == {((0, 8),): [2]}
    before = copy.deepcopy(index)
    targets = gen_targets_of({0: pack([spec(n) for n in ("model.norm.weight", "x0", "x1", "x2")])})
    first = Assignment.from_index(index, meta, 4, targets)
    assert index == before
    assert Assignment.from_index(index, meta, 4, targets) == first
    # each holder set's first box from its first holder (norm of [0, 1, 2, 3], x0 of [0, 2, 3]), x1 and x2 by theirs
    assert first.train_bytes == (32, 16, 16, 0)
