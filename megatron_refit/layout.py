"""Parallel layouts of the trainer and of the generation engine (pure; no torch.distributed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainLayout:
    """Megatron-Core parallel sizes of the trainer. Rank order is Megatron's default
    (``tp-cp-ep-dp-pp``): TP fastest, PP slowest."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    ep: int = 1
    """Expert-parallel size (MoE only)."""
    etp: int = 1
    """Expert tensor-parallel size (MoE only)."""
    dp: int = 1
    """Data-parallel size of the dense (non-expert) parameters."""

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "ep", "etp", "dp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainLayout.{axis} must be a positive int, got {value!r}")
        dense = self.tp * self.dp
        if dense % (self.etp * self.ep) != 0:
            raise ValueError(
                f"TrainLayout: tp*dp={dense} is not divisible by etp*ep={self.etp * self.ep}; "
                "expert parallelism must fit inside the data-parallel x tensor-parallel ranks"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        return self.tp * self.dp // (self.etp * self.ep)

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.ep > 1 or self.etp > 1:
            parts += [f"EP{self.ep}", f"ETP{self.etp}"]
        parts.append(f"DP{self.dp}")
        return "x".join(parts)
