"""The ``megatron_refit`` weight-transfer engine that runs in every vLLM worker.

vLLM creates it (``WeightTransferEngineFactory``, after our ``vllm.general_plugins`` entry
point registered it) when the engine's ``weight_transfer_config.backend`` is
``"megatron_refit"``, and drives it through its four phases:

- ``init_transfer_engine``: join the refit group as generation rank
  ``replica * tp + tp_rank`` (from vLLM's own parallel state), build this rank's targets from
  the live model's parameters and its HF config, and ``prepare()`` the plan with the train
  ranks (collective: every train rank and every worker at once).
- ``start_weight_update``: mark the weights ``updating``.
- ``update_weights`` / ``receive_weights``: receive one refit version; every train rank
  sends this rank exactly its pieces (no gather, no broadcast), and the model is made whole
  before the call returns: in place, vLLM's post-load step (``process_weights_after_loading``:
  FP8, MoE kernel formats); in ``load_weights`` mode the staged pieces go through vLLM's
  layerwise reload (``initialize_layerwise_reload``, the model's ``load_weights``,
  ``finalize_layerwise_reload``; fused-MoE experts set up again as at a first load:
  :mod:`~megatron_refit.engines.vllm.worker.moe_reload`). vLLM runs no forward pass inside a worker call, so a
  request scheduled between two phases (a client that does not pause) sees one complete
  version, never a half-reloaded model. Under ``swap: staged`` the call returns at once and
  the pieces land in staging buffers in a thread of this worker while the engine keeps
  serving the previous version.
- ``update_weights`` again with ``complete`` (``swap: staged``, before the client pauses): wait
  for the staging and its preparation; their error is this call's, so vLLM ends the update
  session and the live model, never touched, serves on.
- ``finish_weight_update``: (``swap: staged``) the staging is complete by then; the staging
  thread has already run vLLM's load and post-load step on a shadow of the model
  (:mod:`~megatron_refit.engines.vllm.worker.prepare`), so under the client's pause the live
  modules only take the shadow's tensors over (a version that cannot be prepared so loads
  there, named in the log); then ``ready`` with the new version.

Before any byte of a refit moves the receiver re-checks that the parameters it writes are
still the model's: storage the engine re-allocated (reload, sleep/wake, ``model.to``) is
re-resolved, a parameter that changed shape or dtype is refused by name on every rank.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from megatron_refit.config.deployment import refuse_wide_ep
from megatron_refit.endpoint.report import RefitReport
from megatron_refit.registry import engine_named, resolved_load
from megatron_refit.engines.hf.checkpoint import hf_param_table, model_shape
from megatron_refit.engines.fused.draft import ModelWithDraft
from megatron_refit.engines.vllm.worker.draft import (begin_session, check_draft_config, prepare_draft,
                                                      reload_draft, split_pieces, vllm_draft)
from megatron_refit.engines.vllm.worker.eplb_map import check_eplb_config, eplb_layout
from megatron_refit.engines.vllm.worker.expert_maps import check_expert_maps
from megatron_refit.engines.vllm.worker.info import MegatronRefitInitInfo, MegatronRefitUpdateInfo
from megatron_refit.engines.fused.live import LiveModelStorage
from megatron_refit.engines.vllm.worker.moe_reload import FirstLoadSetup, check_reloadable
from megatron_refit.engines.vllm.worker.rank import engine_rank
from megatron_refit.engines.vllm.worker.prepare import NotPreparableError, Prepared, prepare
from megatron_refit.engines.vllm.worker.staged_pieces import StagedPiecesStorage
from megatron_refit.errors import RepackedParameterError
from megatron_refit.group.store import note_swap
from megatron_refit.plan.fp8_layout import fp8_param_table
from megatron_refit.plan.gen_layout import deployment_placement, gen_target_specs
from megatron_refit.engine_side.entry import engine_refit

logger = logging.getLogger("megatron_refit")


class MegatronRefitEngine(WeightTransferEngine[MegatronRefitInitInfo, MegatronRefitUpdateInfo]):
    """vLLM worker side of a megatron_refit refit (see the module docstring)."""

    init_info_cls = MegatronRefitInitInfo
    update_info_cls = MegatronRefitUpdateInfo
    supports_draft_weight_update = True
    """Under ``refit.gen_draft`` every refit is a draft session: the version lands in the main
    model and its MTP draft at once (:mod:`~megatron_refit.engines.vllm.worker.draft`)."""

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.member = None
        self.gen_index: int | None = None
        self.state = "stale"
        """``stale`` (no complete refit, or the last one failed), ``updating`` (between
        ``start_weight_update`` and ``finish_weight_update``), ``ready``."""
        self.weights_version: int | None = None
        """Version of the last refit that finished (``ready``)."""
        self.last_report: RefitReport | None = None
        self._received: int | None = None
        self._in_update = False
        self._mode = "in_place"
        self._staged_swap = False
        self._storage = None
        self._timeout_s = 0.0
        self._replica_size = 1
        self._budget_bytes: int | None = None
        """``refit.swap_budget_mb`` in bytes: the staging buffers and the shadow together (None: no bound)."""
        self._staging: Future | None = None
        """``swap: staged``: the receive running in a thread while the engine serves."""
        self._prepared: Prepared | None = None
        """``swap: staged``: the received version, processed beside the live model (None: it
        loads under the pause: not prepared, or not preparable, said in the log)."""
        self.last_swap: dict = {}
        """``swap: staged``: the last swap's ``prepared`` (bool), ``prepare_s``, ``swap_s`` (under
        the pause), ``staging_bytes`` and, when it loaded under the pause, ``why``."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatron_refit_staging")
        self._with_draft: ModelWithDraft | None = None  # refit.gen_draft: the model and vLLM's draft
        self._draft_target: tuple | None = None  # in a draft session: vLLM's draft and its model config

    # -- phase 1 --------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: MegatronRefitInitInfo) -> None:
        if self.member is not None:
            raise RuntimeError("megatron_refit: init_weight_transfer_engine called twice; call "
                               "shutdown_weight_transfer_engine first")
        cfg = init_info.config
        refuse_wide_ep(cfg)  # what vLLM's side does not receive into, before any check
        check_eplb_config(cfg, self.parallel_config)  # sync EPLB only, and only where the section says so
        mode = resolved_load(engine_named("vllm"), cfg.engine_load, cfg.swap)
        if cfg.gen_draft:  # a draft this engine cannot receive into, before any group is joined
            check_draft_config(cfg, self.vllm_config, lora=bool(init_info.lora_rank))
        self.gen_index = self._gen_index(init_info)
        hf_config = self.model_config.hf_config
        params = hf_param_table(hf_config, self.model_config.dtype, draft=cfg.gen_draft)
        if cfg.trainer_quantize_fp8:
            params = fp8_param_table(params)
        shape = model_shape(hf_config)
        rank = self.gen_index % cfg.replica_size  # this rank's pieces: the same in every replica
        layout = cfg.replica_layout(shape.num_experts, getattr(hf_config, "n_group", None))
        live_map = None
        if cfg.gen_eplb:  # the map EPLB serves now, read again at the start of every refit (eplb_map.py)
            layout, live_map = eplb_layout(self.model, layout, shape.num_experts)
        placement = deployment_placement(layout, shape.num_experts)
        if placement is not None:  # a wide deployment: vLLM's own expert map is the one planned
            check_expert_maps(self.model, placement, rank)
        self._staged_swap = cfg.swap == "staged"  # config checked: load_weights mode
        self._with_draft = None  # a connection before this one may have had a draft
        target = self.model
        if cfg.gen_draft:  # the draft's parameters are vLLM's to hand over, at each draft session
            target = self._with_draft = vllm_draft(self.model, hf_config.num_hidden_layers)
        storage, why = None, ""
        if mode in (None, "in_place"):
            try:
                storage = LiveModelStorage.for_model(target, params, layout, shape, gen_index=rank,
                                                     pending=None if target is self.model else target.is_draft,
                                                     live_map=live_map)
                mode = "in_place"
            except RepackedParameterError as exc:
                if mode == "in_place":  # asked for: refused by name, before any byte moves
                    raise
                mode, why = "load_weights", f" ({exc})"
        if mode == "load_weights":
            check_reloadable(self.model)  # MoE experts' post-load step: run again after each reload, or refused
            if placement is not None:
                raise ValueError("refit.engine_load load_weights: vLLM's load_weights of a wide expert-parallel "
                                 "deployment is not planned (each rank's expert slots): use engine_load in_place")
            pieces = gen_target_specs(params, layout, shape, style="vllm")[rank]
            storage = StagedPiecesStorage(self.model, pieces, self.device)
        if cfg.engine_load == "auto":
            logger.info("megatron_refit: engine_load auto: %s%s", mode, why)
        self._mode = mode
        self._storage = storage
        self._timeout_s = cfg.timeout_s
        self._budget_bytes = None if cfg.swap_budget_mb is None else int(cfg.swap_budget_mb * 2**20)
        self._replica_size = cfg.replica_size
        lora = (init_info.lora_rank, init_info.lora_alpha) if init_info.lora_rank else None
        self.member = engine_refit(cfg, storage, gen_index=self.gen_index, num_train=init_info.num_train,
                                 device=self.device, lora=lora)
        self.state = "stale"

    def _gen_index(self, info: MegatronRefitInitInfo) -> int:
        """This rank's engine rank from vLLM's parallel state (:func:`~.rank.engine_rank`)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        return engine_rank(info.config, self.parallel_config, replica=info.replica,
                           tp_rank=get_tensor_model_parallel_rank,
                           moe=model_shape(self.model_config.hf_config).num_experts > 0)

    def _check_initialised(self, what: str) -> None:
        if self.member is None:
            raise RuntimeError(f"megatron_refit: {what} before init_weight_transfer_engine")

    # -- phases 2 to 4 --------------------------------------------------------------------
    def set_weight_update_target(self, model: torch.nn.Module, model_config) -> None:
        """vLLM hands its draft over for a draft session; the refit keeps writing the main model
        (``self.model``) and writes the draft beside it (:meth:`start_weight_update`)."""
        self._draft_target = (model, model_config)

    def reset_weight_update_target(self) -> None:
        self._draft_target = None

    def start_weight_update(self) -> None:
        self._check_initialised("start_weight_update")
        begin_session(self._with_draft, self._draft_target, reload=self._mode == "load_weights")
        if self._staging is not None:
            if not self._staging.done():
                raise RuntimeError("megatron_refit: start_weight_update while the last update's staging still runs; "
                                   "call finish_weight_update first")
            self._staging = None  # an update whose finish never came (its refit failed: the train ranks know)
        self._received = None
        self._prepared = None
        self._in_update = True
        if not self._staged_swap:  # staged: the model keeps serving, the refit lands in staging only
            self.state = "updating"

    def update_weights(self, update_info: dict) -> None:
        info = self.parse_update_info(update_info)
        self.receive_weights(info)
        if self.device.type == "cuda" and self._staging is None:
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: MegatronRefitUpdateInfo) -> None:
        self._check_initialised("update_weights")
        if update_info.complete:
            self._complete(update_info.version)
            return
        if not self._in_update or self._staging is not None:
            raise RuntimeError("megatron_refit: update_weights outside start_weight_update / finish_weight_update "
                               "(or twice in one update)")
        if self._staged_swap:  # returns now: vLLM's engine core schedules forward passes meanwhile
            self._staging = self._pool.submit(self._receive, update_info)
            return
        self._receive(update_info)
        self._make_live()

    def _complete(self, version: int) -> None:
        """``swap: staged``, the update's second call: wait for its staging and preparation (their
        error is this call's: vLLM then ends the update session; the live model was never touched)."""
        if not self._staged_swap or not self._in_update or self._staging is None:
            raise RuntimeError("megatron_refit: update_info.complete is swap: staged's second update_weights call "
                               "of one update, after the one that started its staging")
        self._wait_staging()
        if self._received != version:
            raise RuntimeError(f"megatron_refit: update_info.complete for version {version}, but the staged update "
                               f"received {self._received}")

    def _wait_staging(self) -> None:
        staging, self._staging = self._staging, None
        try:
            staging.result(timeout=self._timeout_s)
        except TimeoutError:
            self._staging = staging  # still running: no new update until it ends
            raise

    def _receive(self, update_info: MegatronRefitUpdateInfo) -> None:
        try:
            report = self.member.receive(update_info.version, full=update_info.full)
            report.engine_load = self._mode
        except BaseException:
            if not self._staged_swap:  # staged: only the staging was written, the model serves on
                self.state = "stale"
            raise
        self.last_report = report
        if self._staged_swap:  # still beside the serving model: its post-load step too
            self._prepare(update_info.version)
        self._received = update_info.version

    def _prepare(self, version: int) -> None:
        """The staged version processed in a shadow of the model (:mod:`.prepare`); a version
        that cannot be is named in the log and loads under the pause, as without, and noted for
        the train ranks (``refit/swap_unprepared``)."""
        staging = self._storage.nbytes
        budget = None if self._budget_bytes is None else self._budget_bytes - staging
        main, draft = split_pieces(self._with_draft)
        try:  # both or neither: a draft that cannot be prepared loads under the pause with the model
            prepared = prepare(self.model, lambda shadow: self._storage.load(shadow, main),
                               first_load_setup=FirstLoadSetup, budget_bytes=budget)
            if self._draft_target is not None:  # the draft's version beside the live draft, one swap
                prepared = prepare_draft(prepared, self._draft_target, lambda shadow: self._storage.load(shadow, draft),
                                         budget)
        except NotPreparableError as exc:
            self.last_swap = dict(prepared=False, why=str(exc), staging_bytes=staging)
            logger.warning("megatron_refit: swap: staged: this version loads under the pause: %s", exc)
            self._note(version, str(exc))
            return
        self._prepared = prepared
        self._note(version, None)
        # what the device holds for the swap: the staging buffers and the shadow's processed tensors
        self.last_swap = dict(prepared=True, prepare_s=prepared.seconds, staging_bytes=staging + prepared.nbytes)

    def _note(self, version: int, why: str | None) -> None:
        """Tell the train ranks whether ``version`` was prepared (``refit/swap_unprepared``); a
        store that fails here costs the count, not the version (logged)."""
        try:
            note_swap(self.member.group.store, version, self.gen_index % self._replica_size, why)
        except Exception as exc:  # noqa: BLE001 -- the version itself is fine
            logger.warning("megatron_refit: swap: staged: could not note version %s for the train ranks: %s",
                           version, exc)

    @torch.no_grad()
    def _make_live(self) -> None:
        """The received version becomes the model's: vLLM's post-load step on the parameters
        written in place, or the staged pieces through vLLM's layerwise reload. If that fails the
        weights are no complete version: ``stale``, and no later finish may call them ready."""
        try:
            if self._mode == "load_weights":
                from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                                     initialize_layerwise_reload)

                main, draft = split_pieces(self._with_draft)
                initialize_layerwise_reload(self.model)
                with FirstLoadSetup(self.model):  # the experts' post-load step too (moe_reload.py)
                    self._storage.load(only=main)
                    finalize_layerwise_reload(self.model, self.model_config)
                if self._draft_target is not None:  # a draft session: the draft's reload, its MTP pieces
                    reload_draft(self._draft_target, lambda model: self._storage.load(model, draft))
            else:
                from vllm.model_executor.model_loader.utils import process_weights_after_loading

                process_weights_after_loading(self.model, self.model_config, self.device)
                if self._draft_target is not None:  # the draft's own, as vLLM runs it at load
                    process_weights_after_loading(*self._draft_target, self.device)
        except BaseException:
            self.state, self._received = "stale", None
            raise

    def finish_weight_update(self) -> None:
        self._check_initialised("finish_weight_update")
        self._in_update = False
        if self._staging is not None:  # no update_info.complete call: its error, if any, is this update's
            self._wait_staging()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        if self._received is None:
            if not self._staged_swap:
                self.state = "stale"
            raise RuntimeError("megatron_refit: finish_weight_update without a completed update_weights since "
                               "start_weight_update: the engine's weights are not a complete refit")
        if self._staged_swap:  # the swap, under the client's pause
            self.state = "updating"
            t0 = time.perf_counter()
            prepared, self._prepared = self._prepared, None
            if prepared is None:
                self._make_live()
            else:
                try:
                    prepared.swap()
                    if self.device.type == "cuda":  # the copies into the live storage done before any step
                        torch.cuda.synchronize(self.device)
                except BaseException:  # half taken over: no complete version, as a failed load
                    self.state, self._received = "stale", None
                    raise
            self.last_swap["swap_s"] = time.perf_counter() - t0
            logger.info("megatron_refit: version %s live: %s", self._received, self.last_swap)
        self.weights_version, self._received = self._received, None
        self.state = "ready"

    def shutdown(self) -> None:
        if self.member is not None:
            self.member.close()
            self.member = None
            self.state = "stale"
