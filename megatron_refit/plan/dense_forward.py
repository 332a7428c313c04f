"""``refit.gen_dense_forward: node``: a deployment's dense weights split over the DP ranks that share a node (pure).

In a wide expert-parallel deployment of ``D`` data-parallel ranks of ``T`` tensor-parallel ranks,
TP rank ``k`` of every DP rank holds the same dense shards (attention, shared experts, embeddings,
norms). Where several DP ranks share a node (``T`` below the node's engine ranks,
``refit.gen_node_ranks``), sending each of them its whole shard from the train ranks puts the
shard ``D`` times through the NICs. Instead each of the ``m`` DP ranks of a node that hold TP rank
``k`` (its **node group**, :func:`node_group`) takes ``1/m`` of each dense shard's rows from the
train ranks (:func:`split`: whole 128-row blocks, so an FP8 weight and its ``scale_inv`` tiles split
alike) and, once its bytes arrived, passes its rows to the others over the node's links (NVLink):
each NIC takes ``1/m`` of the dense bytes. Routed experts are not split (each goes to the ranks whose
slots hold it). A deployment's consecutive engine ranks are taken to share nodes ``node_ranks`` at a
time (vLLM's and SGLang's DP ranks fill a node in order). The cost model weighs it against direct
(``costmodel --json``: ``deployment_forwarding``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megatron_refit.plan.fp8_layout import SCALE_SUFFIX
from megatron_refit.plan.roles import EXPERT_RE
from megatron_refit.plan.spec import ShardSpec

BLOCK = 128
"""Rows of one FP8 scale tile: a slice of a weight starts at a multiple of it (its ``scale_inv``
at the same tile)."""


def node_group(gen_index: int, *, tp: int, attention_dp: int, node_ranks: int) -> tuple[int, ...]:
    """The engine ranks of ``gen_index``'s deployment that hold its TP rank's dense shards on its
    node (``gen_index`` among them), ascending."""
    for name, value in (("tp", tp), ("attention_dp", attention_dp), ("node_ranks", node_ranks)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"node_group: {name} must be a positive int, got {value!r}")
    size = tp * attention_dp
    base, local = gen_index - gen_index % size, gen_index % size
    return tuple(base + j for j in range(local % tp, size, tp) if j // node_ranks == local // node_ranks)


def forwarded(name: str) -> bool:
    """Whether parameter ``name`` is a dense one the DP ranks of a node group share (not a routed expert)."""
    return EXPERT_RE.search(name) is None


def split(spec: ShardSpec, parts: int) -> tuple[tuple[int, int], ...]:
    """Rows ``[start, stop)`` of ``spec``'s box (relative to its first row) that each of ``parts``
    ranks takes: whole blocks of :data:`BLOCK` rows (one row per block for a ``scale_inv``), as
    evenly as blocks allow; a rank past the last block takes none (``(n, n)``)."""
    return _split(spec.name, spec.box[0][1] - spec.box[0][0], parts)


def _split(name: str, rows: int, parts: int) -> tuple[tuple[int, int], ...]:
    unit = 1 if name.endswith(SCALE_SUFFIX) else BLOCK
    blocks = math.ceil(rows / unit)
    per = math.ceil(blocks / parts) if blocks else 0
    out = []
    for j in range(parts):
        start, stop = min(j * per * unit, rows), min((j + 1) * per * unit, rows)
        out.append((start, stop))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DenseForward:
    """One engine rank's part in its node group: the group (engine ranks of the deployment, this
    rank at ``position``) and, per forwarded piece name, every member's rows of it."""

    group: tuple[int, ...]
    position: int
    rows: dict
    """Name -> per member of :attr:`group`, its ``(start, stop)`` rows relative to the piece's box."""

    @classmethod
    def of(cls, specs: list[ShardSpec], group: tuple[int, ...], gen_index: int) -> DenseForward:
        """``specs``: the pieces the rank holds; ``ValueError`` where ``gen_index`` is not in ``group``."""
        if gen_index not in group:
            raise ValueError(f"engine rank {gen_index} is not in its node group {list(group)}")
        counts: dict[str, int] = {}
        for spec in specs:
            counts[spec.name] = counts.get(spec.name, 0) + 1
        rows = {} if len(group) < 2 else {
            spec.name: split(spec, len(group)) for spec in specs if forwarded(spec.name) and counts[spec.name] == 1}
        return cls(group=group, position=group.index(gen_index), rows=rows)

    def narrow(self, specs: list[ShardSpec]) -> list[ShardSpec]:
        """What the rank receives from the train ranks: its rows of each forwarded piece (none where
        its share is empty), every other piece whole."""
        out = []
        for spec in specs:
            rows = self.rows.get(spec.name)
            if rows is None:
                out.append(spec)
                continue
            box = _rows_of(spec.box, rows[self.position])
            if box is not None:
                out.append(replace(spec, box=box))
        return out

    def peers(self) -> tuple[int, ...]:
        """The other members, ascending."""
        return tuple(rank for rank in self.group if rank != self.group[self.position])


def narrow_targets(targets, tp: int, attention_dp: int, node_ranks: int):
    """A :class:`~megatron_refit.plan.gen_layout.GenTargets` of deployments of ``attention_dp`` x
    ``tp`` ranks (class ``i``: deployment rank ``i``) as the engine ranks take them from the train
    ranks under ``refit.gen_dense_forward: node``: each class its rows of every dense parameter
    (:meth:`DenseForward.narrow`'s, for the dry run and the cost model); boxes shared by several
    parameters stay shared."""
    size = tp * attention_dp
    if len(targets.ranks) != size:
        raise ValueError(f"narrow_targets: {len(targets.ranks)} classes of engine ranks, a deployment has {size}")
    groups = [node_group(i, tp=tp, attention_dp=attention_dp, node_ranks=node_ranks) for i in range(size)]
    done: dict[tuple[int, bool], tuple] = {}
    params = {}
    for name, (shape, dtype, boxes) in targets.params.items():
        if not forwarded(name):
            params[name] = (shape, dtype, boxes)
            continue
        key = (id(boxes), name.endswith(SCALE_SUFFIX))
        if key not in done:
            done[key] = tuple(_narrow_box(name, box, group, i) for i, (box, group) in enumerate(zip(boxes, groups)))
        params[name] = (shape, dtype, done[key])
    return type(targets)(ranks=targets.ranks, params=params)


def _narrow_box(name: str, box, group: tuple[int, ...], rank: int):
    if box is None or len(group) < 2:
        return box
    return _rows_of(box, _split(name, box[0][1] - box[0][0], len(group))[group.index(rank)])


def _rows_of(box, rows: tuple[int, int]):
    """``box`` cut to ``rows`` (relative to its first row); None where they are empty."""
    start, stop = rows
    if stop <= start:
        return None
    return ((box[0][0] + start, box[0][0] + stop), *box[1:])
