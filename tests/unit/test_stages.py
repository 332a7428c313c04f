"""The bucket loops' stages (megatron_refit.endpoint.stages), each alone, without a process group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_refit.endpoint.stages import DIGEST_TAG, Drain, ReceiveDigests, SendDigests, Sources
from megatron_refit.errors import RefitCorruptionError, RefitTransportError
from megatron_refit.plan.spec import ShardSpec, full_box


def _bucket(index, *names, src=0, dst=2):
    return SimpleNamespace(index=index, src_rank=src, dst_rank=dst,
                           items=[SimpleNamespace(transfer=SimpleNamespace(name=n)) for n in names])


class _Piece:
    def __init__(self, name, tensor):
        self.spec = ShardSpec(name=name, global_shape=tuple(tensor.shape), dtype="float32",
                              box=full_box(tuple(tensor.shape)))
        self._t, self.reads, self.released = tensor, 0, 0

    def tensor(self):
        self.reads += 1
        return self._t

    def release(self):
        self.released += 1


def test_sources_read_each_piece_once_and_release_it_after_the_last_bucket_that_reads_it():
    pieces = {"a": _Piece("a", torch.ones(4)), "b": _Piece("b", torch.zeros(2))}
    buckets = [_bucket(0, "a", "b"), _bucket(1, "a")]
    sources = Sources(pieces, buckets)
    assert torch.equal(sources("a"), torch.ones(4)) and sources("a") is sources("a")
    sources("b")
    sources.after(buckets[0])  # b's last bucket left; a is read again by bucket 1
    assert (pieces["a"].released, pieces["b"].released) == (0, 1)
    sources.after(buckets[1])
    assert pieces["a"].released == 1 and pieces["a"].reads == 1
    sources.release_all()
    assert (pieces["a"].released, pieces["b"].released) == (2, 2)


def test_sources_name_a_piece_that_is_not_what_its_spec_says():
    piece = _Piece("w", torch.ones(4))
    piece._t = torch.ones(5)
    with pytest.raises(ValueError, match=r"w: the local piece is \(5,\) torch.float32, its spec says \(4,\) float32"):
        Sources({"w": piece}, [_bucket(0, "w")])("w")


class _Group:
    """Records small messages; a receive returns what was sent to it (or ``forged``)."""

    def __init__(self, forged=None):
        self.sent, self.forged = [], forged

    def send_small(self, values, dst, tag):
        self.sent.append((values.clone(), dst, tag))
        return ("sent", dst)

    def recv_small(self, buffer, src, tag):
        return SimpleNamespace(buffer=buffer, src=src, tag=tag)

    def wait(self, pending):
        pass


def _digester(sums, version):
    return torch.stack([s.sum() for s in sums]).to(torch.int64) + version


def _report():
    return SimpleNamespace(seconds={"verify": 0.0})


def test_send_digests_go_once_per_receiver_after_its_last_bucket():
    group = _Group()
    buckets = [_bucket(0, "a", dst=2), _bucket(1, "b", dst=3), _bucket(2, "c", dst=2)]
    digests = SendDigests(group, {2: _digester, 3: _digester}, "full", 7, buckets, lambda b: b.dst_rank, _report())
    digests.add(buckets[0], torch.arange(8, dtype=torch.uint8))
    assert group.sent == []  # receiver 2 still has a bucket coming
    digests.add(buckets[1], torch.arange(4, dtype=torch.uint8))
    digests.add(buckets[2], torch.arange(4, dtype=torch.uint8))
    assert [(dst, tag) for _, dst, tag in group.sent] == [(3, DIGEST_TAG), (2, DIGEST_TAG)]
    assert group.sent[1][0].numel() == 2  # both of receiver 2's buckets in one message
    off = SendDigests(group, {}, "off", 7, buckets, lambda b: b.dst_rank, _report())
    off.add(buckets[0], torch.zeros(1))
    assert len(group.sent) == 2


def test_receive_digests_name_exactly_the_bucket_that_changed_in_flight():
    buckets = [_bucket(0, "layer0.w"), _bucket(1, "layer1.w")]
    data = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    sender = SendDigests(_Group(), {2: _digester}, "full", 3, buckets, lambda b: b.dst_rank, _report())
    for bucket, d in zip(buckets, data):
        sender.add(bucket, d)
    sent = sender.group.sent[0][0]

    def receive(arrived):
        group = _Group()
        digests = ReceiveDigests(group, {0: _digester}, "full", 3, buckets, lambda b: b.src_rank, _report())
        digests.sent[0].buffer.copy_(sent)  # the sender's message, as it arrived
        for bucket, d in zip(buckets, arrived):
            digests.queue(bucket, d)
        digests.flush()
        digests.compare()

    receive(data)  # intact
    bad = data[1].clone()
    bad[5] ^= 0x10
    with pytest.raises(RefitCorruptionError, match=r"refit 3: digest mismatch in 1 bucket\(s\) from refit rank\(s\) "
                                                   r"\[0\] .*\['layer1.w'\]"):
        receive([data[0], bad])


def test_drain_keeps_the_first_own_failure_and_raises_a_broken_group_at_once():
    drain = Drain()
    assert not drain.draining
    first = RefitCorruptionError("refit 2: bucket 0 is malformed")
    drain.fail(first)
    drain.fail(RuntimeError("a later one"))
    assert drain.draining and drain.failure is first
    with pytest.raises(RefitTransportError, match="peer gone"):
        Drain().fail(RefitTransportError("peer gone"))
