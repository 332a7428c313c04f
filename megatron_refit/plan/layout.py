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
    first_stage_layers: int | None = None
    """Decoder layers on the first pipeline stage when uneven (Megatron's
    ``num_layers_in_first_pipeline_stage``); None: an even share."""
    last_stage_layers: int | None = None
    """Decoder layers on the last pipeline stage when uneven (Megatron's
    ``num_layers_in_last_pipeline_stage``); None: an even share."""

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "ep", "etp", "dp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainLayout.{axis} must be a positive int, got {value!r}")
        for field in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value < 1 or self.pp < 2):
                raise ValueError(f"TrainLayout.{field} must be None or a positive int with pp >= 2, got {value!r}"
                                 f" (pp={self.pp})")
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

    def coordinates(self, rank: int) -> dict[str, int]:
        """Megatron's default rank order: dense ``tp-cp-dp-pp``, experts ``etp-ep-edp-pp``."""
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        inner = rank % (self.tp * self.dp)
        etp = inner % self.etp
        ep = (inner // self.etp) % self.ep
        edp = inner // (self.etp * self.ep)
        return dict(tp=tp, dp=dp, pp=pp, etp=etp, ep=ep, edp=edp)

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.ep > 1 or self.etp > 1:
            parts += [f"EP{self.ep}", f"ETP{self.etp}"]
        parts.append(f"DP{self.dp}")
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            parts.append(f"L{self.first_stage_layers or '-'}+{self.last_stage_layers or '-'}")  # file-name safe
        return "x".join(parts)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers per pipeline stage; ``ValueError`` if they do not split evenly."""
        first, last = self.first_stage_layers, self.last_stage_layers
        middle_stages = self.pp - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        if middle_layers < 0 or (middle_stages == 0 and middle_layers) or (
                middle_stages and middle_layers % middle_stages):
            raise ValueError(
                f"num_layers={num_layers} does not split over pp={self.pp} stages with "
                f"first_stage_layers={first}, last_stage_layers={last} (layout {self.describe()})"
            )
        each = middle_layers // middle_stages if middle_stages else 0
        stages = [each] * self.pp
        if first is not None:
            stages[0] = first
        if last is not None:
            stages[-1] = last
        return stages
