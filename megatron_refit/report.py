"""What one refit did on one rank: bytes, seconds per phase, routes taken."""

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
    seconds: dict = field(default_factory=lambda: dict(total=0.0, pack=0.0, transfer=0.0, load=0.0, verify=0.0,
                                                       onload=0.0, offload=0.0))
    """``load``: gen-side unpacking; ``verify``: computing and exchanging bucket digests
    (overlapping transfers in flight); ``onload`` / ``offload``: moving offloaded trainer
    parameters back before the refit and out again after it (0.0 when that did not run)."""
    routes: dict = field(default_factory=lambda: dict(direct=0, packed=0, shared=0))
    """Buckets by route: ``direct`` (straight from / into the tensor, no staging copy),
    ``packed`` (through a staging buffer over the process group), ``shared`` (through a
    shared staging buffer, colocated mode)."""

    @property
    def gbps(self) -> float:
        moved = self.bytes_sent + self.bytes_received
        return moved / self.seconds["total"] / 1e9 if self.seconds["total"] > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "gbps": self.gbps}
