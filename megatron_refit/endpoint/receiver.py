"""The generation side of a refit: :class:`Receiver` writes this rank's pieces into the
engine's storage (a :class:`~megatron_refit.endpoint.storage.Storage`) and keeps its
``stale → updating → ready`` state; see :mod:`megatron_refit.endpoint.sender` for the protocol."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import torch

from megatron_refit.endpoint.base import DIGEST_TAG, Endpoint, adjacent_pieces, delta_tag
from megatron_refit.endpoint.bytes import repack_bucket, unpack_bucket
from megatron_refit.endpoint.delta import RAW, apply, check_header, check_payload, word_size
from megatron_refit.endpoint.integrity import chunk_sums
from megatron_refit.endpoint.report import RefitReport
from megatron_refit.endpoint.storage import ExpectsVersion, Storage, RefreshesTargets, TracksState
from megatron_refit.errors import RefitCorruptionError, RefitTransportError
from megatron_refit.plan.checks import ITEMSIZE
from megatron_refit.plan.spec import ShardSpec
from megatron_refit.transport import Transport


class Receiver(Endpoint):
    """Generation side: receives this rank's pieces into ``storage`` (the engine's memory)."""

    role = "gen"

    def __init__(self, group: Transport, storage: Storage, *, num_train: int, num_gen: int,
                 bucket_bytes: int = 64 << 20, verify: str = "sampled", direct_bytes: int | str | None = "auto",
                 on_report: Callable[[dict], None] | None = None, delta: str = "off",
                 replica_size: int | None = None):
        super().__init__(group, num_train=num_train, num_gen=num_gen, bucket_bytes=bucket_bytes, verify=verify,
                         direct_bytes=direct_bytes, on_report=on_report, delta=delta, replica_size=replica_size)
        if group.rank < num_train:
            raise ValueError(f"refit rank {group.rank} is a train rank (num_train={num_train})")
        self.storage = storage
        self.gen_index = group.rank - num_train
        self.state = "stale"
        self.weights_version: int | None = None
        """Version of the last complete refit (None before the first)."""
        self._moved = False
        """The engine re-allocated its parameters since the last refit: the next is a full one."""
        self._set_state("stale")

    def _set_state(self, state: str) -> None:
        self.state = state
        if isinstance(self.storage, TracksState):
            self.storage.set_state(state, self.weights_version)

    def _local_specs(self) -> list[ShardSpec]:
        return list(self.storage.target_specs())

    def _local_adjacent(self) -> list[tuple[str, str]]:
        # from the engine storage's addresses (it stays put between refits)
        return adjacent_pieces({spec.name: self.storage.buffer(spec.name) for spec in self.storage.target_specs()})

    def _delta_base(self) -> int:
        # the engine's own version (a LoRA engine's two receivers share it), while it is ready
        version = getattr(self.storage, "weights_version", self.weights_version)
        if self.state != "ready" or self._moved or version is None or not getattr(self.storage, "holds_sent_bytes",
                                                                                   False):
            return -1
        return version

    def _refresh_targets(self) -> None:
        self._moved = False
        if not isinstance(self.storage, RefreshesTargets):
            return
        try:
            self._moved = bool(self.storage.refresh_targets())
        except BaseException:
            self._set_state("stale")  # the engine's storage is no longer what the last refit wrote
            raise

    def receive(self, version: int | None = None) -> RefitReport:
        """Receive refit ``version`` (None: the version the train ranks send next, as a replica
        that joined a running trainer does). On any failure the weights are marked ``stale`` (the
        engine must not serve them) and the error propagates; the next complete refit
        restores ``ready``. A failure of this rank's own (its storage raising, a malformed
        or corrupted payload) is confined to it: the rest of the refit is received and
        dropped, so the group and every other rank carry on."""
        version, delta_from = self._agree_on_version(version, self._refresh_targets)
        if isinstance(self.storage, ExpectsVersion):  # a staged engine tags the swap with it
            self.storage.expect_version(version)
        self._set_state("updating")
        try:
            report = self._receive(version, delta_from)
        except BaseException:
            self._set_state("stale")
            raise
        self.weights_version = version
        self._set_state("ready")
        self._emit(report)
        return report

    def _receive(self, version: int, delta_from: set[int] = frozenset()) -> RefitReport:
        start = time.perf_counter()
        report = RefitReport(version=version, role="gen", rank=self.group.rank,
                             bytes_minimal=self.plan.bytes_minimal, delta=bool(delta_from))
        buckets = self.plan.buckets_to(self.gen_index)
        report.bytes_full = sum(b.payload_bytes for b in buckets)
        received: dict[int, list] = {}  # sender -> [(bucket, chunk sums)] in plan order
        digesters = self._pair_digesters(buckets, self.plan.global_src) if self.verify != "off" else {}
        left = Counter(self.plan.global_src(b) for b in buckets)  # buckets still to come, per sender
        computed: dict[int, torch.Tensor] = {}  # sender -> digests of what arrived
        sent = {}  # sender -> its digest message, posted before the first bucket
        if self.verify != "off":
            sent = {src: self.group.recv_small(torch.zeros(n, dtype=torch.int64), src, DIGEST_TAG)
                    for src, n in left.items()}
        codes = {}  # delta refits: (src, index) -> (encoding, size), from the header before each bucket
        scratch = []
        unchecked = []  # buckets in engine storage whose digest pass waits until the next bucket is posted
        failure: list[Exception] = []
        """This rank's first error (its storage, a payload): from then on every bucket is
        received into staging and dropped, so that every sender's messages are still taken."""

        def fail(exc: Exception) -> None:
            if isinstance(exc, RefitTransportError):  # the group itself failed: there is nothing to drain
                raise exc
            failure[:1] = failure[:1] or [exc]
            unchecked.clear()

        def check_arrived():
            t0 = time.perf_counter()
            for bucket, buf in unchecked:
                src = self.plan.global_src(bucket)
                received.setdefault(src, []).append((bucket, chunk_sums(buf, self.verify)))
                left[src] -= 1
                if not left[src]:
                    computed[src] = digesters[src]([s for _, s in received[src]], version).cpu()
            unchecked.clear()
            report.seconds["verify"] += time.perf_counter() - t0

        def post(bucket, buf):
            src = self.plan.global_src(bucket)
            encoding, size = RAW, bucket.nbytes
            if src in delta_from:
                header = self.group.recv_small(torch.zeros(2, dtype=torch.int64), src, delta_tag(bucket.index))
                self.group.wait(header)
                encoding, size = codes[bucket.src_rank, bucket.index] = header.buffer.cpu().tolist()
                problem = check_header(encoding, size, bucket.nbytes)
                if problem is not None:  # the payload's size is unknown: it cannot even be drained
                    raise RefitCorruptionError(f"refit {version}: {self._bucket_name(bucket)}: its delta header is "
                                               f"malformed ({problem})")
            direct = None
            if not failure and encoding == RAW:
                try:
                    direct = self._direct_view(bucket, self.storage.buffer, "dst")
                except Exception as exc:  # noqa: BLE001 -- this rank's storage failed: drain the rest
                    fail(exc)
            self._route(report, direct is not None)
            if direct is not None:  # straight into engine storage
                pending = self.group.irecv(direct, src, bucket.index)
                pending.direct = True
                return pending
            return self.group.irecv(buf[:size], src, bucket.index)  # staging (delta: the changed elements)

        def retire(bucket, pending):
            buf = pending.buffer
            encoding, size = codes.get((bucket.src_rank, bucket.index), (RAW, 0))
            report.bytes_received += bucket.payload_bytes if encoding == RAW else size
            report.bytes_wire += buf.numel()
            if failure:  # dropped
                return
            try:
                self._apply(bucket, pending, encoding, buf, scratch, unchecked, report, version)
            except Exception as exc:  # noqa: BLE001 -- this rank's storage or payload failed: drain the rest
                fail(exc)
                return
            if unchecked and not (pending.direct and encoding == RAW):  # a staging or scratch buffer, reused next
                check_arrived()

        with torch.no_grad():
            self._run(buckets, post, retire, report)
            if failure:  # every message of the refit taken: the group is intact; the trainer learns why
                for pending in sent.values():
                    self.group.wait(pending)
                report.seconds["total"] = time.perf_counter() - start
                self._summarize(report, failure[0])
                raise failure[0]
            check_arrived()
            try:
                self._check_and_finalize(version, sent, computed, received, report)
            except Exception as exc:
                try:  # every byte arrived: the group is intact, tell the trainer this rank failed
                    self._summarize(report, exc)
                except Exception:  # noqa: BLE001 -- this rank's own error is the one to raise
                    pass
                raise
        self.version = version
        report.seconds["total"] = time.perf_counter() - start
        self._summarize(report)
        return report

    def _apply(self, bucket, pending, encoding: int, buf: torch.Tensor, scratch: list, unchecked: list,
               report: RefitReport, version: int) -> None:
        """One arrived bucket into engine storage: unpacked from staging, or a delta checked
        and written over the previous version's bytes; queued for its digest pass."""
        if encoding != RAW:  # onto the previous version's bytes, in engine storage
            t0 = time.perf_counter()
            buf = self._apply_delta(bucket, encoding, buf, scratch, version)
            report.seconds["load"] += time.perf_counter() - t0
        if self.verify != "off":  # of the bytes as they arrived (in engine storage when direct)
            unchecked.append((bucket, buf))
        if pending.direct or encoding != RAW:  # already in engine storage
            return
        t0 = time.perf_counter()
        unpack_bucket(bucket, buf, self.storage.buffer)
        report.seconds["load"] += time.perf_counter() - t0

    def _bucket_name(self, bucket) -> str:
        names = sorted({item.transfer.name for item in bucket.items})
        return (f"bucket {bucket.index} from refit rank {self.plan.global_src(bucket)} (parameters "
                f"{names[:8]}{' ...' if len(names) > 8 else ''})")

    def _apply_delta(self, bucket, encoding: int, payload: torch.Tensor, scratch: list, version: int) -> torch.Tensor:
        """The bucket's new bytes: the previous version's (engine storage) with the changed
        words written over, back into engine storage, once the payload is checked
        (:class:`~megatron_refit.errors.RefitCorruptionError` naming the bucket, before
        anything is written). Returns them (for the digests)."""
        word = word_size(bucket.nbytes, (ITEMSIZE[item.transfer.dtype] for item in bucket.items))
        problem = check_payload(encoding, payload, bucket.nbytes, word)
        if problem is not None:
            raise RefitCorruptionError(f"refit {version}: {self._bucket_name(bucket)}: its delta payload is "
                                       f"malformed ({problem}); nothing of it was written")
        target = self._direct_view(bucket, self.storage.buffer, "dst")
        if target is not None:  # contiguous in engine storage: in place
            apply(target, encoding, payload, word)
            return target
        if not scratch or scratch[0].numel() < bucket.nbytes:
            scratch[:] = [torch.empty(bucket.nbytes, dtype=torch.uint8, device=payload.device)]
        target = scratch[0][: bucket.nbytes].zero_()  # padding as the sender packed it: zeros
        repack_bucket(bucket, self.storage.buffer, out=target)
        apply(target, encoding, payload, word)
        unpack_bucket(bucket, target, self.storage.buffer)
        return target

    def _check_and_finalize(self, version: int, sent: dict, computed: dict, received: dict,
                            report: RefitReport) -> None:
        """Compare the digests each sender computed with what arrived, then run the
        engine's post-load step."""
        if self.verify != "off":
            t0 = time.perf_counter()
            corrupted = []
            for src, pending in sent.items():
                self.group.wait(pending)
                mismatch = (computed[src] != pending.buffer.cpu()).nonzero().flatten().tolist()
                corrupted += [received[src][i][0] for i in mismatch]
            report.seconds["verify"] += time.perf_counter() - t0
            if corrupted:
                names = sorted({item.transfer.name for b in corrupted for item in b.items})
                sources = sorted({self.plan.global_src(b) for b in corrupted})
                raise RefitCorruptionError(
                    f"refit {version}: digest mismatch in {len(corrupted)} bucket(s) from refit rank(s) "
                    f"{sources} (bytes changed in flight, or misrouted); parameters "
                    f"{names[:8]}{' ...' if len(names) > 8 else ''}"
                )
        t0 = time.perf_counter()
        self.storage.finalize()
        report.seconds["load"] += time.perf_counter() - t0
