"""``RefitCallback``: the refit inside Megatron-Bridge's own training loop.

Bridge's ``pretrain(config, forward_step_func, callbacks=[...])`` / ``finetune(...)`` fire
training callbacks (``megatron.bridge.training.callbacks``); this one is all a training
script adds to refit the generation engine::

    bridge_config, refit_cfg = load_training_yaml("train.yaml", overrides=sys.argv[1:])
    callbacks = [RefitCallback.from_config(refit_cfg, bridge)] if refit_cfg.enabled else []
    pretrain(config, forward_step_func, callbacks=callbacks)

- ``on_train_start``: enumerate this train rank's HF-named local shards of ``context.model``
  (the DDP-wrapped chunks: the shards are views of their params), join the refit group
  (train rank = this process's rank in the trainer's world), build the plan with the engine
  ranks and send the starting weights (version ``train_state.step``: 0, or the iteration a
  resumed run starts from), so the engine never starts from other weights than the
  trainer's (``initial_refit=False`` skips it when both load the same checkpoint).
- ``on_train_step_end``: refit, with the iteration number as the version (Bridge's step
  counter after this step: ``train_state.step + 1``), every ``refit.every_n_steps``
  iterations; a skipped iteration (``context.skipped_iter``) sends nothing. What travels is
  what the engine computes with: the model params (bf16 with Megatron's mixed precision),
  not the optimizer's fp32 main params; with ``overlap_param_gather`` the step's param
  all-gather is forced to finish first (Bridge's ``force_param_sync``), so no refit sends a
  half-gathered replica.
- ``on_train_end``: release the refit group (under ``refit.overlap: on``, after the refit in
  flight has landed or failed; each of its waits is bounded by ``refit.timeout_s``).

With ``refit.overlap: on`` a due refit snapshots the bytes this rank sends (a device-side copy)
and returns; they move in the background while the next iteration trains, each version landing
as the weights were at its iteration. A refit that is due while the last still moves waits for
it (``overlap_busy: wait``) or is skipped on every train rank (``skip``; the iterations are in
``skipped_busy``). At every step boundary the refits that finished since are logged at their
own iteration, and one that failed raises there, its version named. Ctrl-C does not wait: the
sending thread is a daemon, and the engines see the trainer's ranks go (their next wait fails).

Each refit is the fleet's own ``refit``. With ``engines`` (control clients, one per engine
replica: vLLM's ``HTTPClient`` / ``LLMClient``, SGLang's ``EngineClient`` / ``HTTPClient``), the
fleet is built with the engine's control (:func:`megatron_refit.engines.control.engine_control`
for ``refit.engine``) and train rank 0 drives the engines through it: at connect, around each
replica's part of every refit (vLLM: ``init_weight_transfer_engine``, then per refit start /
update / finish, shutdown; SGLang: connect, then per refit pause / update / resume, close) and
at close; without, the fleet's calls run alone (an engine that runs its own receive loop, the HF
engine).

Each refit's group metrics (one flat dict, ``refit/total_s``, ``refit/gbps``, ``refit/bytes``
…) go to the training run's own TensorBoard and Weights & Biases writers (Bridge's
``state.tensorboard_logger`` / ``state.wandb_logger``, on the rank that holds them) at the
refit's iteration, beside Bridge's own throughput and loss curves; ``on_report`` is called
with them too.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_refit.config import RefitConfig
from megatron_refit.engines.control import engine_control
from megatron_refit.endpoint.report import RefitReport

from conversion.te_shim import import_bridge

import_bridge()
from megatron.bridge.training.callbacks import Callback  # noqa: E402


def hf_config_of(bridge):
    """The Hugging Face config an ``AutoBridge`` was built from (``from_hf_config`` or
    ``from_hf_pretrained``)."""
    from transformers import PretrainedConfig

    held = bridge.hf_pretrained
    return held if isinstance(held, PretrainedConfig) else held.config


def log_to_bridge(state, metrics: dict, iteration: int) -> None:
    """Write one refit's flat metrics to the writers of Bridge's training state, as Bridge
    writes its own (``add_scalar(name, value, iteration)``, ``wandb.log(dict, step)``); the
    writers exist only on the rank Bridge logs from, the others write nothing."""
    if not metrics:
        return
    writer = getattr(state, "tensorboard_logger", None)
    if writer is not None:
        for name, value in metrics.items():
            writer.add_scalar(name, value, iteration)
    wandb_writer = getattr(state, "wandb_logger", None)
    if wandb_writer is not None:
        wandb_writer.log(metrics, iteration)


def force_param_sync(model: list, optimizer=None) -> None:
    """Finish the data-parallel param all-gather of the last step now, where DDP defers it to
    the next forward (``overlap_param_gather``), as Bridge's ``force_param_sync`` does before
    a checkpoint. Without overlap the gather already ran inside ``optimizer.step()``."""
    chunks = [c for c in model if getattr(getattr(c, "ddp_config", None), "overlap_param_gather", False)]
    if not chunks:
        return
    from conversion.cpu_shim import cuda_calls_on_cpu

    with cuda_calls_on_cpu():
        if optimizer is not None and hasattr(optimizer, "prepare_model_params_for_param_sync"):
            optimizer.prepare_model_params_for_param_sync()
        for chunk in chunks:
            chunk.start_param_sync(force_sync=True)


class RefitCallback(Callback):
    """Refits the generation engine from Bridge's training loop (see the module docstring)."""

    def __init__(self, cfg: RefitConfig, bridge, *, hf_config=None, initial_refit: bool = True, offloader=None,
                 on_report: Callable[[dict], None] | None = None, engines: list | None = None):
        if not isinstance(cfg, RefitConfig):
            raise ValueError(f"RefitCallback takes the refit: section as a RefitConfig (load_training_yaml), "
                             f"got {type(cfg).__name__}")
        if not cfg.enabled:
            raise ValueError("refit.enabled is false: set enabled: true in the refit section of the training config")
        self.cfg = cfg
        self.bridge = bridge
        self.hf_config = hf_config if hf_config is not None else hf_config_of(bridge)
        self.initial_refit = initial_refit
        self.offloader = offloader
        self.on_report = on_report
        self.engines = list(engines or [])
        """Control clients, one per engine replica (used on train rank 0)."""
        self.control = engine_control(cfg, self.engines)
        """The engine's control (:class:`~megatron_refit.engines.control.EngineControl`; None without
        clients), which the fleet drives on train rank 0."""
        self.rank = 0
        self.fleet = None
        """The :class:`~megatron_refit.fleet.trainer_fleet.TrainerFleet` of this rank (after ``on_train_start``)."""
        self.last_report: RefitReport | None = None
        self.skipped: list[int] = []
        """Iterations that were skipped (and not refitted)."""
        self.skipped_busy: list[int] = []
        """``overlap_busy: skip``: iterations not refitted because the last refit still moved."""

    @classmethod
    def from_config(cls, cfg: RefitConfig, bridge, **kwargs) -> RefitCallback:
        """The callback for the ``refit:`` section ``cfg`` and the ``AutoBridge`` the model was
        built from (its HF config says what the engine serves)."""
        return cls(cfg, bridge, **kwargs)

    def on_train_start(self, context) -> None:
        import torch.distributed as dist

        from conversion.refit import trainer_refit

        if self.fleet is not None:
            raise RuntimeError("RefitCallback: on_train_start twice; one callback serves one training run")
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.rank = rank

        self.fleet = trainer_refit(self.cfg, self.bridge, context.model, self.hf_config, rank=rank, num_train=world,
                                   offloader=self.offloader, on_report=self.on_report, control=self.control)
        if self.initial_refit:
            force_param_sync(context.model, context.optimizer)
            step = context.state.train_state.step
            self.last_report = self.fleet.refit(step)
            log_to_bridge(context.state, self.last_report.summary, step)

    def on_train_step_end(self, context) -> None:
        if self.fleet is None:
            raise RuntimeError("RefitCallback: on_train_step_end before on_train_start")
        iteration = context.state.train_state.step + 1  # Bridge counts the step after this event
        self._log_finished(context, self.fleet.finished())  # overlap: a failed one raises here
        if context.skipped_iter:
            self.skipped.append(iteration)
            return
        if iteration % self.cfg.every_n_steps:
            return
        force_param_sync(context.model, context.optimizer)
        if self.fleet.background is None:
            self._log_finished(context, [self.fleet.refit(iteration)])
        elif not self.fleet.start_refit(iteration):  # the engine control's calls: the fleet's
            self.skipped_busy.append(iteration)

    def _log_finished(self, context, reports: list[RefitReport]) -> None:
        for report in reports:
            self.last_report = report
            log_to_bridge(context.state, report.summary, report.version)

    def on_train_end(self, context) -> None:
        if self.fleet is not None:
            fleet, self.fleet = self.fleet, None
            try:
                if fleet.background is not None:  # the refit in flight lands (or fails) first
                    fleet.background.wait()
                    self._log_finished(context, fleet.finished())
            finally:
                fleet.close()  # train rank 0 tells the engines first
