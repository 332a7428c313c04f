"""The generation side of a refit: :class:`Receiver` writes this rank's pieces into the
engine's storage (a :class:`~megatron_refit.endpoint.storage.Storage`) and keeps its
``stale → updating → ready`` state; see :mod:`megatron_refit.endpoint.sender` for the protocol."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from megatron_refit.endpoint.base import MAX_DIRECT_IN_FLIGHT, Endpoint
from megatron_refit.endpoint.dense_exchange import exchange
from megatron_refit.endpoint.delta import delta_tag
from megatron_refit.endpoint.direct import adjacent_pieces
from megatron_refit.endpoint.bytes import repack_bucket, unpack_bucket
from megatron_refit.endpoint.delta import RAW, apply, check_header, check_payload, word_size
from megatron_refit.endpoint.relay import DeltaNotApplicableError, forwarder, receive_relayed
from megatron_refit.endpoint.stages import Drain, ReceiveDigests
from megatron_refit.endpoint.report import RefitReport
from megatron_refit.endpoint.storage import (ExpectsVersion, KeepsSentBytes, LiveBuffers, MovesExperts,
                                             RefreshesTargets, ReportsVersion, Storage, TracksState)
from megatron_refit.errors import RefitCorruptionError
from megatron_refit.plan.checks import ITEMSIZE
from megatron_refit.plan.dense_forward import DenseForward, node_group
from megatron_refit.plan.spec import ShardSpec
from megatron_refit.transport import Transport


class Receiver(Endpoint):
    """Generation side: receives this rank's pieces into ``storage`` (the engine's memory)."""

    role = "gen"

    def __init__(self, group: Transport, storage: Storage, *, num_train: int, num_gen: int,
                 bucket_bytes: int = 64 << 20, verify: str = "sampled", direct_bytes: int | str | None = "auto",
                 on_report: Callable[[dict], None] | None = None, delta: str = "off",
                 replica_size: int | None = None, relay=None, stall_s: float = 0.0,
                 gate: Callable[[int], None] | None = None, dense_forward: tuple[int, int, int] | None = None):
        super().__init__(group, num_train=num_train, num_gen=num_gen, bucket_bytes=bucket_bytes, verify=verify,
                         direct_bytes=direct_bytes, on_report=on_report, delta=delta, replica_size=replica_size,
                         stall_s=stall_s)
        self.relay = relay
        """``refit.fanout``: this rank's :class:`~megatron_refit.endpoint.relay.RelayLinks` (None: it
        never relays; a placement that asks it to is refused)."""
        if group.rank < num_train:
            raise ValueError(f"refit rank {group.rank} is a train rank (num_train={num_train})")
        self.storage = storage
        self._landed = None
        """The digests of the last refit that landed (:meth:`stale_live` reads the engine against them)."""
        self.gen_index = group.rank - num_train
        self.state = "stale"
        self.weights_version: int | None = None
        """Version of the last complete refit (None before the first)."""
        self._moved = False
        """The engine re-allocated its parameters since the last refit: the next is a full one."""
        self.gate = gate
        """The engine's :meth:`~megatron_refit.endpoint.storage.GatesTraffic.gate`, called at the start
        of a refit the train ranks will check (``refit.verify_serving``); its member releases it."""
        self.forward: DenseForward | None = None
        """``refit.gen_dense_forward: node`` (``dense_forward``: the deployment's ``(tp, attention_dp,
        node_ranks)``): the rows of the dense shards this rank takes from the train ranks and passes on
        to its node group (:mod:`~megatron_refit.endpoint.dense_exchange`); None: every piece whole."""
        if dense_forward is not None:
            tp, attention_dp, node_ranks = dense_forward
            members = node_group(self.gen_index, tp=tp, attention_dp=attention_dp, node_ranks=node_ranks)
            if len(members) > 1:
                self.forward = DenseForward.of(list(storage.target_specs()), members, self.gen_index)
        self._set_state("stale")

    def _set_state(self, state: str) -> None:
        self.state = state
        if isinstance(self.storage, TracksState):
            self.storage.set_state(state, self.weights_version)

    def _local_specs(self) -> list[ShardSpec]:
        specs = list(self.storage.target_specs())
        return specs if self.forward is None else self.forward.narrow(specs)

    def _local_adjacent(self) -> list[tuple[str, str]]:
        # from the engine storage's addresses (it stays put between refits)
        return adjacent_pieces({spec.name: self._buffer(spec.name) for spec in self._local_specs()})

    def _buffer(self, name: str) -> torch.Tensor:
        """Where this rank's bytes of piece ``name`` go: the storage's view, or under
        ``refit.gen_dense_forward`` its rows of a forwarded piece."""
        view = self.storage.buffer(name)
        rows = None if self.forward is None else self.forward.rows.get(name)
        if rows is None:
            return view
        start, stop = rows[self.forward.position]
        return view[start:stop]

    def delta_base(self) -> int:
        # the engine's own version (a LoRA engine's two receivers share it), while it is ready
        version = self.storage.weights_version if isinstance(self.storage, ReportsVersion) else self.weights_version
        keeps = isinstance(self.storage, KeepsSentBytes) and self.storage.holds_sent_bytes
        if self.state != "ready" or self._moved or self.experts_moved or version is None or not keeps:
            return -1
        return version

    def _refresh_targets(self) -> None:
        """The handshake's preflight: the engine's parameters re-resolved where it re-allocated them,
        then its expert map re-read where its load balancer moves experts (``experts_moved``: the
        group re-plans them in the handshake)."""
        self._moved = self.experts_moved = False
        try:
            if isinstance(self.storage, RefreshesTargets):
                self._moved = bool(self.storage.refresh_targets())
            if isinstance(self.storage, MovesExperts):
                self.experts_moved = bool(self.storage.refresh_experts())
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
        if self.probe_due and self.gate is not None:  # scored before it takes traffic
            self.gate(version)
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
        """Every bucket of this rank's part of refit ``version``, through the stages: digest
        (:class:`~megatron_refit.endpoint.stages.ReceiveDigests`), delta (a header before each
        bucket from ``delta_from``'s senders), drain (:class:`~megatron_refit.endpoint.stages.Drain`:
        after this rank's own failure, every bucket is still taken); then the engine's post-load
        step. This rank's failure is raised after every rank knows of it."""
        start = time.perf_counter()
        report = RefitReport(version=version, role="gen", rank=self.group.rank,
                             bytes_minimal=self.plan.bytes_minimal, delta=bool(delta_from))
        buckets = self.plan.buckets_to(self.gen_index)
        report.bytes_full = sum(b.payload_bytes for b in buckets)
        digesters = self._pair_digesters(buckets, self.plan.global_src) if self.verify != "off" else {}
        placement = self.placement
        readback = self.probe_due and self._live()  # checked: every byte read back
        digests = ReceiveDigests(self.group, digesters, self.verify, version, buckets, self.plan.global_src, report,
                                 post=not placement.relayed, readback=readback)
        run = _ReceiveRun(self, version, delta_from, digests, Drain(), report)
        with torch.no_grad():
            run.forward = forwarder(self, placement, buckets, report) if placement.successors else None
            try:
                if placement.relayed:
                    receive_relayed(self, placement, buckets, run, report)
                else:
                    self.run_buckets(buckets, run.post, run.retire, report, direct_window=run.window)
                if run.forward is not None:  # the train ranks' digests go on with the bytes
                    digests.wait_sent()
                    run.forward.digests({src: pending.buffer for src, pending in digests.sent.items()})
            except BaseException as exc:
                if run.forward is not None:  # its successors stop waiting for it now
                    run.forward.abort(f"relay replica {self.relay.replica}'s own refit failed: {type(exc).__name__}")
                raise
            failure = None
            if run.drain.draining:  # every message of the refit taken: the group is intact; the trainer learns why
                digests.wait_sent()
                failure = run.drain.failure
            else:
                digests.flush()
                try:
                    digests.compare()
                except Exception as exc:  # noqa: BLE001 -- raised below, once the node group's exchange is done
                    failure = exc
            if self.forward is not None:  # every member of the node group, whatever its own outcome
                failure = self._forward_dense(report, failure)
            if failure is not None and run.drain.draining:
                report.seconds["total"] = time.perf_counter() - start
                self._summarize(report, failure)
                raise failure
            try:
                if failure is not None:
                    raise failure
                t0 = time.perf_counter()
                self.storage.finalize()
                report.seconds["load"] += time.perf_counter() - t0
            except Exception as exc:
                try:  # every byte arrived: the group is intact, tell the trainer this rank failed
                    self._summarize(report, exc)
                except Exception:  # noqa: BLE001 -- this rank's own error is the one to raise
                    pass
                raise
        self.version = version
        self._landed = digests
        report.seconds["total"] = time.perf_counter() - start
        self._summarize(report)
        return report

    def _forward_dense(self, report: RefitReport, failure: BaseException | None) -> BaseException | None:
        """``refit.gen_dense_forward``: this rank's rows to its node group and theirs to it
        (:func:`~megatron_refit.endpoint.dense_exchange.exchange`); the refit's failure, this rank's
        own first."""
        t0 = time.perf_counter()
        try:
            exchange(self.group, self.num_train, self.forward, self.storage.buffer, ok=failure is None,
                     check=self.verify != "off")
        except Exception as exc:  # noqa: BLE001 -- this rank's outcome, reported with the refit's
            failure = failure or exc
        report.seconds["transfer"] += time.perf_counter() - t0
        return failure

    def _live(self) -> bool:
        return isinstance(self.storage, LiveBuffers) and self.storage.live_buffers

    def stale_live(self) -> list[str]:
        """The parameters of the last refit that the engine no longer holds as they arrived, read
        back from its storage and digested again (:meth:`~megatron_refit.endpoint.stages.ReceiveDigests.stale_in`):
        a tensor its post-load step left stale or changed. Only for a storage whose ``buffer()`` is
        the weights it serves after ``finalize()`` (``live_buffers``: the HF engine's); [] elsewhere."""
        if self._landed is None or not self._live():
            return []
        return self._landed.stale_in(self._buffer)

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
        target = self._direct_view(bucket, self._buffer, "dst")
        if target is not None:  # contiguous in engine storage: in place
            apply(target, encoding, payload, word)
            return target
        if not scratch or scratch[0].numel() < bucket.nbytes:
            scratch[:] = [torch.empty(bucket.nbytes, dtype=torch.uint8, device=payload.device)]
        target = scratch[0][: bucket.nbytes].zero_()  # padding as the sender packed it: zeros
        repack_bucket(bucket, self._buffer, out=target)
        apply(target, encoding, payload, word)
        unpack_bucket(bucket, target, self._buffer)
        return target


class _ReceiveRun:
    """One refit's bucket loop on a receiver: ``post`` and ``retire`` for
    :meth:`~megatron_refit.endpoint.base.Endpoint.run_buckets`, chaining the stages."""

    def __init__(self, receiver: Receiver, version: int, delta_from: set[int], digests: ReceiveDigests, drain: Drain,
                 report: RefitReport):
        self.rx, self.version, self.delta_from = receiver, version, delta_from
        self.digests, self.drain, self.report = digests, drain, report
        self.codes: dict = {}  # delta refits: (src, index) -> (encoding, size), from the header before each bucket
        self.scratch: list[torch.Tensor] = []
        self.group = receiver.group
        """Where the buckets come from: the refit group, or a relayed rank's upstream link."""
        self.forward = None
        """A relay's :class:`~megatron_refit.endpoint.relay.Forwarder` (None: it forwards nothing)."""
        self.retired = 0
        self.forwarding = True
        """Off while a relayed rank takes again buckets its relay corrupted: its successors had them
        as it did, and take them again themselves."""
        self.delta_ok = True
        """A relayed rank: the relay's delta payloads apply to this rank's weights."""
        self._retired_by_src: dict[int, int] = {}

    @property
    def window(self) -> int:
        """Direct buckets in flight at most: two on a relay (it forwards each as it retires it)."""
        return 2 if self.forward is not None else MAX_DIRECT_IN_FLIGHT

    def use(self, group, delta_from: set[int], *, chain_base: int) -> None:
        """The next buckets come over ``group``, a header before each from ``delta_from``; the
        relay's delta payloads apply here when this rank holds ``chain_base``."""
        if group is not None:
            self.group = group
        self.delta_from = delta_from
        self.codes = {}  # a header of a bucket in flight when a relay failed: that bucket comes again, raw
        self.delta_ok = chain_base >= 0 and self.rx.shown_base == chain_base

    def done_by_src(self, num_train: int) -> list[int]:
        """Buckets retired so far from each train rank (a prefix of each pair's, in plan order)."""
        return [self._retired_by_src.get(src, 0) for src in range(num_train)]

    def post(self, bucket, buf):
        rx = self.rx
        src = rx.plan.global_src(bucket)
        encoding, size = RAW, bucket.nbytes
        if src in self.delta_from:
            encoding, size = self._header(bucket, src)
        direct = None
        if not self.drain.draining and encoding == RAW:
            try:
                direct = rx._direct_view(bucket, rx._buffer, "dst")
            except Exception as exc:  # noqa: BLE001 -- this rank's storage failed: drain the rest
                self._fail(exc)
        rx.count_path(self.report, direct is not None)
        if direct is not None:  # straight into engine storage
            pending = self.group.irecv(direct, src, bucket.index)
            pending.direct = True
            return pending
        return self.group.irecv(buf[:size], src, bucket.index)  # staging (delta: the changed elements)

    def _header(self, bucket, src: int) -> tuple[int, int]:
        """A delta bucket's header: ``(encoding, size)``. A malformed one fails this rank (named)
        and the bucket is drained at its largest size, the whole bucket (a payload never exceeds it)."""
        rx = self.rx
        header = self.group.recv_small(torch.zeros(2, dtype=torch.int64), src, delta_tag(bucket.index))
        self.group.wait(header)
        encoding, size = header.buffer.cpu().tolist()
        if encoding != RAW and not self.delta_ok:  # a relay's delta on another base: from the train ranks, raw
            raise DeltaNotApplicableError(f"a delta payload on version {rx.placement.chain_base}, this rank holds "
                                 f"{rx.shown_base}")
        problem = check_header(encoding, size, bucket.nbytes)
        if problem is not None:
            self._fail(RefitCorruptionError(f"refit {self.version}: {rx._bucket_name(bucket)}: its delta header is "
                                            f"malformed ({problem}); the bucket is dropped"))
            encoding, size = RAW, bucket.nbytes
        self.codes[bucket.src_rank, bucket.index] = encoding, size
        return encoding, size

    def _fail(self, exc: Exception) -> None:
        self.drain.fail(exc)
        self.digests.drop_queued()

    def retire(self, bucket, pending) -> None:
        buf = pending.buffer
        encoding, size = self.codes.get((bucket.src_rank, bucket.index), (RAW, 0))
        self.report.bytes_received += bucket.payload_bytes if encoding == RAW else size
        self.report.bytes_wire += buf.numel()
        src = self.rx.plan.global_src(bucket)
        self.retired += 1
        self._retired_by_src[src] = self._retired_by_src.get(src, 0) + 1
        if self.forward is not None and self.forwarding:  # as it arrived (its own failure leaves its bytes good)
            self.forward.bucket(src, bucket, encoding, buf, stable=pending.direct and encoding == RAW)
        self._take(bucket, pending, encoding, buf)

    def _take(self, bucket, pending, encoding: int, buf: torch.Tensor) -> None:
        if self.drain.draining:  # dropped
            return
        try:
            self._apply(bucket, pending, encoding, buf)
        except Exception as exc:  # noqa: BLE001 -- this rank's storage or payload failed: drain the rest
            self._fail(exc)
            return
        if self.digests.unchecked and not (pending.direct and encoding == RAW):  # staging / scratch, reused next
            self.digests.flush()

    def _apply(self, bucket, pending, encoding: int, buf: torch.Tensor) -> None:
        """One arrived bucket into engine storage: unpacked from staging, or a delta checked
        and written over the previous version's bytes; queued for its digest pass."""
        rx, report = self.rx, self.report
        if encoding != RAW:  # onto the previous version's bytes, in engine storage
            t0 = time.perf_counter()
            buf = rx._apply_delta(bucket, encoding, buf, self.scratch, self.version)
            report.seconds["load"] += time.perf_counter() - t0
        self.digests.queue(bucket, buf)  # the bytes as they arrived (in engine storage when direct)
        if pending.direct or encoding != RAW:  # already in engine storage
            return
        t0 = time.perf_counter()
        unpack_bucket(bucket, buf, rx._buffer)
        report.seconds["load"] += time.perf_counter() - t0

