"""A train rank's end of one replica's refit group: :class:`TrainerMember` (the engine rank's end
is :class:`~megatron_refit.engine_side.member.EngineMember`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from megatron_refit.config import RefitConfig
from megatron_refit.endpoint.sender import Refitter
from megatron_refit.errors import ServingMismatchError
from megatron_refit.group.inband import exchange_in_band, verdict_in_band
from megatron_refit.group.member import Member, endpoint_kw


class TrainerMember(Member):
    """Train side of the refit (one per train rank); see the module docstring. ``plans``: plans
    built already (shared by a train rank's replica groups: one plan per replica layout)."""

    def __init__(self, group, pieces: list, adapters: list, cfg: RefitConfig, *, num_train: int,
                 on_report: Callable[[dict], None] | None = None, plans: dict | None = None):
        kw = dict(endpoint_kw(cfg, num_train, on_report), plans=plans, check_finite=cfg.check_finite,
                  draft=cfg.gen_draft)
        self.group = group
        if adapters and cfg.lora_sync != "full" and cfg.gen_eplb:
            raise ValueError(f"refit.lora_sync={cfg.lora_sync!r} with refit.gen_eplb: an adapters-only refit does not "
                             "re-plan the experts the engine's balancer moved; set lora_sync: full")
        if adapters and cfg.lora_sync != "full" and cfg.gen_dense_forward != "off":
            raise ValueError(f"refit.lora_sync={cfg.lora_sync!r} with refit.gen_dense_forward: an adapters-only refit "
                             "plans no forwarded rows; set lora_sync: full")
        self.full = Refitter(group, pieces + adapters, **kw)
        self.full.prepare()
        self.adapters = None
        if adapters and cfg.lora_sync != "full":
            self.adapters = Refitter(group, adapters, **kw)
            self.adapters.prepare()

    @property
    def plan(self):
        """The full refit's plan (re-planned in a handshake where the engine's experts moved)."""
        return self.full.plan

    def sent(self, version: int) -> None:
        """Refit ``version`` went through :meth:`endpoint` (its report is the endpoint's): the next
        refit advances past it, and moves adapters only again under LoRA adapter sync.

        The fleet calls the endpoint's ``refit`` itself (one frame less between a replica's lane and
        the wire: :func:`~megatron_refit.fleet.replica.refit_replica`), collective over the refit
        group: every train and engine rank calls it with the same ``version`` and ``full``."""
        self._advance(version)
        self._resend = False

    def verdict_in_band(self, probe, judge: Callable[[object], dict] | None) -> tuple[object, float]:
        """Train rank 0, once every rank applied a refit sent with ``probe`` (``refit.verify_serving``,
        in band): the engine's answer to it, and train rank 0's verdict on it (``judge(answer)``:
        :meth:`~megatron_refit.fleet.serving.ServingCheck.verdict`), which the engine ranks hear
        before the call returns: one that fails holds its weights. The other train ranks take no
        part in the probe (:mod:`~megatron_refit.group.inband`). Returns the verdict (None: not
        asked; a failed one as its :class:`~megatron_refit.errors.ServingMismatchError`, once told)
        and the seconds from the answer's request to the verdict told."""
        t0 = time.perf_counter()
        answer = exchange_in_band(self.group, self.full.num_train, probe=probe)
        verdict = None
        try:
            verdict = judge(answer) if judge is not None else None
        except ServingMismatchError as exc:
            verdict = exc
        finally:  # told whatever judge did (an error of its own is this replica's outcome, untold)
            failed = str(verdict) if isinstance(verdict, ServingMismatchError) else None
            verdict_in_band(self.group, self.full.num_train, failed=failed)
        return verdict, time.perf_counter() - t0

    def force_full(self, *, adapters: bool) -> None:
        """The replica failed this refit: its next one is full (no delta; with ``adapters``, the
        base weights too under LoRA adapter sync, where its engine follows the trainer's choice)."""
        for endpoint in (self.full, self.adapters):
            if endpoint is not None:
                endpoint.forget_delta_base()
        self._resend = adapters
