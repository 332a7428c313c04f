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
    """Megatron ``num_layers_in_first_pipeline_stage`` (uneven PP); None: an even split."""
    last_stage_layers: int | None = None
    """Megatron ``num_layers_in_last_pipeline_stage`` (uneven PP); None: an even split."""

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "ep", "etp", "dp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainLayout.{axis} must be a positive int, got {value!r}")
        for field in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value < 1 or self.pp < 2):
                raise ValueError(f"TrainLayout.{field} must be a positive int with pp > 1, got {value!r}")
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

    def stage_layers(self, num_layers: int) -> list[int]:
        """Transformer layers per pipeline stage, as Megatron splits ``num_layers``."""
        first = self.first_stage_layers if self.first_stage_layers is not None else 0
        last = self.last_stage_layers if self.last_stage_layers is not None else 0
        middle = self.pp - (self.first_stage_layers is not None) - (self.last_stage_layers is not None)
        rest = num_layers - first - last
        if rest < 0 or (middle and rest % middle) or (not middle and rest):
            raise ValueError(
                f"num_layers={num_layers} cannot be split over pp={self.pp} with "
                f"first_stage_layers={self.first_stage_layers}, last_stage_layers={self.last_stage_layers}"
            )
        even = rest // middle if middle else 0
        return [
            first if stage == 0 and self.first_stage_layers is not None
            else last if stage == self.pp - 1 and self.last_stage_layers is not None
            else even
            for stage in range(self.pp)
        ]

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
            parts.append(f"L{self.first_stage_layers or 'even'}+{self.last_stage_layers or 'even'}")
        return "x".join(parts)
