"""Parallel layouts of the trainer and of the generation engine (pure; no torch.distributed)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from megatron_refit.plan import pipeline_layout as pl


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainLayout:
    """Megatron-Core parallel settings of the trainer: every one that decides which weights a
    rank holds. Rank order is Megatron's default (``tp-cp-ep-dp-pp``): TP fastest, PP slowest;
    the experts' ranks ``etp-ep-edp-pp`` over the same ranks. Layers per (pipeline rank, virtual
    stage): :meth:`chunk_layers`, as Megatron computes them (:mod:`megatron_refit.plan.pipeline_layout`)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    ep: int = 1
    """Expert-parallel size (MoE only)."""
    etp: int = 1
    """Expert tensor-parallel size (MoE only)."""
    dp: int = 1
    """Data-parallel size of the dense (non-expert) parameters, context parallelism apart."""
    cp: int = 1
    """Context-parallel size: CP ranks hold the same weights as DP ranks (the sequence is split)."""
    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (Megatron's ``virtual_pipeline_model_parallel_size``):
    each rank holds one model chunk per virtual stage; None: one chunk."""
    first_stage_layers: int | None = None
    """Decoder layers on the first pipeline stage when uneven (Megatron's
    ``num_layers_in_first_pipeline_stage``); None: an even share."""
    last_stage_layers: int | None = None
    """Decoder layers on the last pipeline stage when uneven (Megatron's
    ``num_layers_in_last_pipeline_stage``); None: an even share."""
    account_for_embedding: bool = False
    """Megatron's ``account_for_embedding_in_pipeline_split``: the embedding takes one layer's room."""
    account_for_loss: bool = False
    """Megatron's ``account_for_loss_in_pipeline_split``: the loss takes one layer's room."""
    layout: pl.Stages | None = None
    """Megatron's ``pipeline_model_parallel_layout``, parsed (a string or list of lists is
    accepted and parsed): stage ``s`` on pipeline rank ``s % pp``, virtual stage ``s // pp``."""
    mtp_layers: int = 0
    """Multi-token-prediction layers (Megatron's ``mtp_num_layers``)."""
    sequence_parallel: bool = False
    """Megatron's ``sequence_parallel``: activations split over TP between layers (weights unchanged;
    the stages exchange ``[seq / tp, …]``)."""

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "ep", "etp", "dp", "cp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TrainLayout.{axis} must be a positive int, got {value!r}")
        if self.vpp is not None and (not isinstance(self.vpp, int) or isinstance(self.vpp, bool) or self.vpp < 1):
            raise ValueError(f"virtual_pipeline_model_parallel_size must be None or a positive int, got {self.vpp!r}")
        if self.vpp == 1:
            object.__setattr__(self, "vpp", None)  # one chunk per rank, as without it
        if self.vpp is not None and self.pp < 2:
            raise ValueError(f"virtual_pipeline_model_parallel_size={self.vpp} needs pipeline_model_parallel_size > 1, "
                             f"got {self.pp}")
        for field in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value < 1 or self.pp < 2):
                raise ValueError(f"TrainLayout.{field} must be None or a positive int with pp >= 2, got {value!r}"
                                 f" (pp={self.pp})")
        if not isinstance(self.mtp_layers, int) or isinstance(self.mtp_layers, bool) or self.mtp_layers < 0:
            raise ValueError(f"mtp_num_layers must be a non-negative int or null, got {self.mtp_layers!r}")
        if self.sequence_parallel and self.tp < 2:
            raise ValueError("sequence_parallel: true needs tensor_model_parallel_size > 1 (Megatron: cannot use "
                             f"sequence parallelism without tensor parallelism), got {self.tp}")
        uneven = self.first_stage_layers is not None or self.last_stage_layers is not None
        if uneven and (self.account_for_embedding or self.account_for_loss):
            raise ValueError("num_layers_in_first/last_pipeline_stage cannot be set together with "
                             "account_for_embedding/loss_in_pipeline_split (Megatron refuses it)")
        if self.layout is not None:
            self._set_layout(uneven)
        dense = self.tp * self.cp * self.dp
        if dense % (self.etp * self.ep) != 0:
            raise ValueError(
                f"TrainLayout: tp*cp*dp={dense} is not divisible by etp*ep={self.etp * self.ep}; "
                "expert parallelism must fit inside the data-parallel x context-parallel x tensor-parallel ranks"
            )

    def _set_layout(self, uneven: bool) -> None:
        if uneven or self.account_for_embedding or self.account_for_loss:
            raise ValueError(f"model.{pl.LAYOUT_KEY} cannot be set with num_layers_in_first/last_pipeline_stage or "
                             "account_for_embedding/loss_in_pipeline_split (Megatron refuses it)")
        value = pl.parse_layout(self.layout, self.pp)  # a string, or lists from YAML / JSON
        object.__setattr__(self, "layout", value)
        detected = len(value) // self.pp
        if self.vpp is not None and self.vpp != detected:
            raise ValueError(f"virtual_pipeline_model_parallel_size={self.vpp} conflicts with {pl.LAYOUT_KEY}: "
                             f"{len(value)} stages over pipeline_model_parallel_size={self.pp} are {detected} "
                             "virtual stages")
        if detected > 1:
            object.__setattr__(self, "vpp", detected)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_dp(self) -> int:
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    @property
    def num_chunks(self) -> int:
        """Model chunks per rank (the virtual pipeline size)."""
        return self.vpp or 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """Megatron's default rank order: dense ``tp-cp-dp-pp``, experts ``etp-ep-edp-pp``."""
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        inner_size = self.tp * self.cp * self.dp
        pp = rank // inner_size
        inner = rank % inner_size
        etp = inner % self.etp
        ep = (inner // self.etp) % self.ep
        edp = inner // (self.etp * self.ep)
        return dict(tp=tp, cp=cp, dp=dp, pp=pp, etp=etp, ep=ep, edp=edp)

    def describe(self) -> str:
        """``TP2xCP2xPP4xVPP5xEP8xETP1xDP4`` and the other keys that are set (file-name safe)."""
        parts = [f"TP{self.tp}"]
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        parts.append(f"PP{self.pp}")
        if self.vpp is not None:
            parts.append(f"VPP{self.vpp}")
        if self.ep > 1 or self.etp > 1:
            parts += [f"EP{self.ep}", f"ETP{self.etp}"]
        parts.append(f"DP{self.dp}")
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            parts.append(f"L{self.first_stage_layers or '-'}+{self.last_stage_layers or '-'}")
        if self.account_for_embedding or self.account_for_loss:
            parts.append("A" + "E" * self.account_for_embedding + "L" * self.account_for_loss)
        if self.layout is not None:
            text = pl.layout_text(self.layout)
            parts.append("Lay" + hashlib.sha256(text.encode()).hexdigest()[:8])
        if self.mtp_layers:
            parts.append(f"MTP{self.mtp_layers}")
        if self.sequence_parallel:
            parts.append("SP")
        return "x".join(parts)

    def describe_keys(self) -> str:
        """Every Megatron key of this layout that is set, as the dry run prints it."""
        keys = [f"TP{self.tp}", f"CP{self.cp}", f"PP{self.pp}", f"VPP{self.vpp or 1}", f"EP{self.ep}",
                f"ETP{self.etp}", f"DP{self.dp}"]
        if self.sequence_parallel:
            keys.append("SP")
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            keys.append(f"first/last stage layers {self.first_stage_layers}/{self.last_stage_layers}")
        if self.account_for_embedding or self.account_for_loss:
            keys.append("account for " + "+".join(n for n, on in (("embedding", self.account_for_embedding),
                                                                   ("loss", self.account_for_loss)) if on))
        if self.layout is not None:
            keys.append(f"layout {pl.layout_text(self.layout)}")
        if self.mtp_layers:
            keys.append(f"MTP{self.mtp_layers}")
        return " ".join(keys)

    def chunk_layers(self, num_layers: int) -> dict[tuple[int, int], range]:
        """``{(pipeline rank, virtual stage): decoder layer ids}`` as Megatron builds them;
        ``ValueError`` naming the keys where ``num_layers`` does not split."""
        if self.layout is not None:
            pl.check_layout(self.layout, self.pp, num_layers=num_layers, mtp_layers=self.mtp_layers)
        return pl.chunk_layers(num_layers=num_layers, pp=self.pp, vpp=self.vpp, first=self.first_stage_layers,
                               last=self.last_stage_layers, account_for_embedding=self.account_for_embedding,
                               account_for_loss=self.account_for_loss, stages=self.layout)

    def mtp_stages(self) -> dict[tuple[int, int], int]:
        """``{(pipeline rank, virtual stage): MTP layers}`` where they are built."""
        return pl.mtp_stages(pp=self.pp, vpp=self.vpp, mtp_layers=self.mtp_layers, stages=self.layout)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers per pipeline rank (all its virtual stages); ``ValueError`` if they do not split."""
        chunks = self.chunk_layers(num_layers)
        return [sum(len(chunks[rank, vp]) for vp in range(self.num_chunks)) for rank in range(self.pp)]
