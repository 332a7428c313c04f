"""What one refit did: per rank (:class:`RefitReport`) and for the whole group
(:func:`summarize`, one flat dict of scalars a metrics logger takes as is)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RefitReport:
    version: int
    role: str
    rank: int
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_wire: int = 0
    """Bytes on the wire: payload plus alignment padding inside buckets (≤ 15 per item)."""
    bytes_minimal: int = 0
    """Sum over generation ranks of the bytes they must hold (the whole refit's floor)."""
    bytes_full: int = 0
    """What this rank sends (train) or receives (gen) in a full refit; a delta refit's
    ``bytes_sent`` / ``bytes_received`` are less."""
    delta: bool = False
    """This refit sent only the changed elements (``refit.delta``)."""
    words: int = 0
    words_changed: int = 0
    """Train side: bucket words compared, and those that changed since the last refit
    (``refit.delta``; their ratio is the refit's density)."""
    seconds: dict = field(default_factory=lambda: dict(total=0.0, pack=0.0, transfer=0.0, load=0.0, verify=0.0,
                                                       onload=0.0, offload=0.0))
    """``load``: gen-side unpacking; ``verify``: computing and exchanging bucket digests
    (overlapping transfers in flight); ``onload`` / ``offload``: moving offloaded trainer
    parameters back before the refit and out again after it (0.0 when that did not run)."""
    paths: dict = field(default_factory=lambda: dict(direct=0, packed=0, shared=0))
    """Buckets by path: ``direct`` (straight from / into the tensor, no staging copy),
    ``packed`` (through a staging buffer over the process group), ``shared`` (through a
    shared staging buffer, colocated mode)."""
    summary: dict = field(default_factory=dict)
    """The whole refit group's metrics (:func:`summarize`): the same flat dict on every rank."""
    failed_ranks: dict = field(default_factory=dict)
    """Refit ranks of this group that could not apply this refit, with their own errors."""
    engine_load: str | None = None
    """Engine side: how the engine wrote this refit (``in_place`` / ``load_weights``: what
    ``refit.engine_load: auto`` chose), where the engine says."""
    bytes_relayed: int = 0
    """Engine side, ``refit.fanout``: bytes this rank forwarded to other replicas."""
    relay_fallback: bool = False
    """Engine side, ``refit.fanout``: this rank's upstream relay failed (or its payloads did not
    apply here) and the train ranks sent it the rest."""
    failed_replicas: dict = field(default_factory=dict)
    """Engine replicas (index: ``gen rank // gen_tp``) that could not apply this refit, with
    why (their ranks' own errors, ``"refit rank N: <error>"``); the same on every rank. Those
    replicas are stale; the others hold the version."""

    @property
    def gbps(self) -> float:
        moved = self.bytes_sent + self.bytes_received
        return moved / self.seconds["total"] / 1e9 if self.seconds["total"] > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "gbps": self.gbps}


_US = 1e6
_TIMES = ("total", "pack", "load", "verify", "onload", "offload")


_FIELDS = ("failed", "bytes_sent", "bytes_received", "bytes_wire", "buckets", *(f"us_{t}" for t in _TIMES),
           "bytes_full", "delta", "words", "words_changed", "bytes_relayed", "relay_fallback")
"""What each rank contributes to the group summary, in the order a control message carries it."""


def report_values(report: RefitReport, failed: bool) -> list[int]:
    """This rank's share of the group summary, as the ints a control message carries (:data:`_FIELDS`)."""
    values = dict(failed=int(failed), buckets=sum(report.paths.values()) if report.role == "train" else 0,
                  relay_fallback=int(report.relay_fallback),
                  delta=int(report.delta), **{f"us_{t}": round(report.seconds[t] * _US) for t in _TIMES})
    return [values[f] if f in values else getattr(report, f) for f in _FIELDS]


SUMMARY_KEYS = ("refit/version", "refit/ok", "refit/failed_ranks", "refit/replicas_ok", "refit/replicas_failed",
                "refit/total_s", "refit/gbps", "refit/bytes",
                "refit/bytes_wire", "refit/bytes_minimal", "refit/bytes_full", "refit/delta", "refit/density",
                "refit/buckets", "refit/pack_s", "refit/load_s", "refit/verify_s", "refit/onload_s",
                "refit/offload_s", "refit/slowest_rank", "refit/train_ranks", "refit/gen_ranks", "refit/bytes_relayed",
                "refit/relay_fallbacks", "refit/skipped_params")
"""The keys :func:`summarize` returns, in order (docs/quickstart.md says what each means)."""


def replicas_of(failed_ranks, num_train: int, replica_size: int) -> list[int]:
    """The engine replicas that hold any of the refit ranks ``failed_ranks`` (train ranks hold none)."""
    return sorted({(rank - num_train) // replica_size for rank in failed_ranks if rank >= num_train})


def summarize(version: int, rows: list[list[int]], num_train: int, bytes_minimal: int,
              replica_size: int | None = None, *, skipped_params: int = 0) -> dict:
    """The flat metrics of one refit from every rank's :func:`report_values` (``rows[r]`` is
    refit rank ``r``; train ranks first). Seconds are the slowest rank's (the group waits for
    it); bytes are summed over train ranks (each byte is sent once). ``replica_size``: engine
    ranks per replica (``gen_tp``; default: all of them are one replica); ``skipped_params``:
    the plan's optional parameters that no engine rank holds (MTP layers)."""
    rows = [dict(zip(_FIELDS, row[:len(_FIELDS)], strict=True)) for row in rows]
    train, gen = rows[:num_train], rows[num_train:]
    seconds = {t: [row[f"us_{t}"] / _US for row in rows] for t in _TIMES}
    total = max(seconds["total"])
    sent = sum(row["bytes_sent"] for row in train)
    failed = [rank for rank, row in enumerate(rows) if row["failed"]]
    replica_size = replica_size or max(1, len(gen))
    replicas_failed = len(replicas_of(failed, num_train, replica_size))
    out = {
        "refit/version": version,
        "refit/ok": int(not failed),
        "refit/failed_ranks": len(failed),
        "refit/replicas_ok": len(gen) // replica_size - replicas_failed,
        "refit/replicas_failed": replicas_failed,
        "refit/total_s": total,
        "refit/gbps": sent / total / 1e9 if total > 0 else 0.0,
        "refit/bytes": sent,
        "refit/bytes_wire": sum(row["bytes_wire"] for row in train),
        "refit/bytes_minimal": bytes_minimal,
        "refit/bytes_full": sum(row["bytes_full"] for row in train),
        "refit/delta": int(any(row["delta"] for row in train)),
        "refit/density": sum(row["words_changed"] for row in train) / max(1, sum(row["words"] for row in train)),
        "refit/buckets": sum(row["buckets"] for row in train),
        "refit/pack_s": max(seconds["pack"][:num_train]),
        "refit/load_s": max(seconds["load"][num_train:], default=0.0),
        "refit/verify_s": max(seconds["verify"]),
        "refit/onload_s": max(seconds["onload"][:num_train]),
        "refit/offload_s": max(seconds["offload"][:num_train]),
        "refit/slowest_rank": seconds["total"].index(total),
        "refit/train_ranks": len(train),
        "refit/gen_ranks": len(gen),
        "refit/bytes_relayed": sum(row["bytes_relayed"] for row in gen),
        "refit/relay_fallbacks": sum(row["relay_fallback"] for row in gen),
        "refit/skipped_params": skipped_params,
    }
    return out


def merge_reports(version: int, rank: int, reports: list[RefitReport], *, replicas: list[int], failures: dict,
           seconds: float, moved: dict, moved_max: dict) -> RefitReport:
    """One train rank's report of a fleet refit: its members' (bytes summed, phases the slowest,
    ``seconds`` its whole call) and the fleet's metrics (``refit/replicas_ok`` …) from the
    members' group summaries, which every train rank holds alike, so the metrics are the same
    on every train rank (``moved_max``: the slowest train rank's parameter onload / offload)."""
    out = RefitReport(version=version, role="train", rank=rank)
    for r in reports:
        for key in ("bytes_sent", "bytes_wire", "bytes_minimal", "bytes_full", "words", "words_changed"):
            setattr(out, key, getattr(out, key) + getattr(r, key))
        out.delta |= r.delta
        for key, value in r.seconds.items():
            out.seconds[key] = max(out.seconds[key], value)
        for key, value in r.paths.items():
            out.paths[key] += value
    out.seconds.update(total=seconds, **moved)
    out.failed_replicas = dict(sorted(failures.items()))
    summaries = [r.summary for r in reports if r.summary]
    total = lambda key: sum(s[key] for s in summaries)  # noqa: E731
    peak = lambda key: max((s[key] for s in summaries), default=0.0)  # noqa: E731
    sent = total("refit/bytes")
    failed = len(out.failed_replicas)
    wall = peak("refit/total_s")  # the slowest replica's group
    out.summary = {
        "refit/version": version,
        "refit/ok": int(not failed),
        "refit/failed_ranks": total("refit/failed_ranks"),
        "refit/replicas_ok": len([r for r in replicas if r not in failures]),
        "refit/replicas_failed": failed,
        "refit/total_s": wall,
        "refit/gbps": sent / wall / 1e9 if wall > 0 else 0.0,
        "refit/bytes": sent,
        "refit/bytes_wire": total("refit/bytes_wire"),
        "refit/bytes_minimal": total("refit/bytes_minimal"),
        "refit/bytes_full": total("refit/bytes_full"),
        "refit/delta": int(any(s["refit/delta"] for s in summaries)),
        "refit/density": (sum(s["refit/density"] * s["refit/bytes_full"] for s in summaries)
                          / max(1, total("refit/bytes_full"))),
        "refit/buckets": total("refit/buckets"),
        "refit/pack_s": peak("refit/pack_s"),
        "refit/load_s": peak("refit/load_s"),
        "refit/verify_s": peak("refit/verify_s"),
        "refit/onload_s": moved_max["onload"],
        "refit/offload_s": moved_max["offload"],
        "refit/slowest_rank": max(summaries, key=lambda s: s["refit/total_s"])["refit/slowest_rank"]
        if summaries else 0,
        "refit/train_ranks": max((s["refit/train_ranks"] for s in summaries), default=0),
        "refit/gen_ranks": total("refit/gen_ranks"),
        "refit/bytes_relayed": total("refit/bytes_relayed"),
        "refit/relay_fallbacks": total("refit/relay_fallbacks"),
        "refit/skipped_params": int(peak("refit/skipped_params")),
    }
    return out
