"""Run Megatron-Bridge's real ``pretrain()`` on a tiny model with mock data: on a CPU machine
over gloo (the patches below), or on a GPU as it is (nccl).

:func:`run_tiny_pretrain` builds a ConfigContainer (Bridge's provider for an HF config,
local layer spec, bf16 params, the distributed optimizer with fp32 main params, Adam, mock
GPT data, NullTokenizer) and calls ``megatron.bridge.training.pretrain.pretrain`` with the
caller's Bridge callbacks. Everything below is patched only for the duration of the call and
restored afterwards; with CUDA available no CUDA patch is applied (the import stubs still are
where the optional packages are missing).

Import stubs (only where the real package is absent; removed from ``sys.modules`` afterwards):
- ``nvidia_resiliency_ext``: imported unconditionally by bridge's pretrain/checkpointing
  (inprocess restart, async ckpt).
- ``modelopt``: imported unconditionally by bridge's train/eval/gpt_step/checkpointing (distillation, modelopt state).
- ``datasets``: imported unconditionally by bridge's data package (HF/SFT datasets), unused with mock data.
- ``megatron.energon``: imported unconditionally by bridge's data package (energon loaders), unused with mock data.
- ``torch.utils.tensorboard``: bridge's state.py imports its SummaryWriter at module level;
  tensorboard is not installed.

On CPU and GPU alike, where the wheel ships no Makefile (``make`` would fail and it calls
``sys.exit(1)``; the prebuilt helpers .so is used): ``initialize.compile_helpers`` a no-op.

CPU patches (none when CUDA is available):
- ``setup.initialize_megatron``: called with ``allow_no_cuda=True`` (setup() never passes it; it asserts CUDA).
- ``torch.cuda.synchronize``: no-op (Megatron's timers call it on every start/stop).
- ``torch.cuda.Stream``: a host stand-in (Megatron's DDP wrapping builds an init stream; ``torch.cuda.stream(...)``
  is already a no-op without CUDA).
- ``torch.cuda.current_device`` -> "cpu": Megatron allocates on it (DDP buffers, RoPE, MoE aux-loss scale).
- ``torch.cuda.current_stream``: a host stand-in (DDP grad sync waits on it).
- CUDA RNG tracker ``fork``: no-op context (the tracker is only seeded with CUDA; the models here use no dropout).
- a ``TorchFunctionMode`` (conversion.testing.megatron_optim): ``device="cuda"`` factory calls make host tensors,
  ``Tensor.cuda()`` is a no-op, ``Tensor.type()`` answers ``torch.cuda.*`` names (Megatron's dtype checks).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import time
import types

import torch

# Optional packages stubbed when absent (torch.utils.tensorboard too, when tensorboard is missing).
_STUBBED_PACKAGES = (
    "nvidia_resiliency_ext",  # bridge's pretrain.py and checkpointing.py import it at module level
    "modelopt",  # bridge's train/eval/gpt_step/checkpointing import it at module level
    "datasets",  # bridge's data package (HF/SFT datasets) imports it at module level; unused with mock data
    "megatron.energon",  # bridge's data package (energon loaders) imports it at module level; unused here
)


class _Stub(types.ModuleType):
    """Inert module: every attribute is a placeholder class; submodules are stubs too."""

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = type(attr, (), {"__module__": self.__name__, "__init__": _refuse})
        setattr(self, attr, value)
        return value


def _refuse(self, *args, **kwargs):
    raise RuntimeError(f"{type(self).__module__}.{type(self).__name__} is a stub (package not installed)")


class _StubFinder:
    """Serves :class:`_Stub` modules for ``roots`` and everything under them."""

    def __init__(self, roots):
        self.roots = tuple(roots)

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == r or fullname.startswith(r + ".") for r in self.roots):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        if spec.name.endswith("distill.plugins.megatron"):
            # train()/evaluate() call it every step: no distillation, no tensor-shape adjustment
            module.get_tensor_shapes_adjust_fn_for_distillation = lambda *a, **k: None
        if spec.name.endswith("tensorboard.writer"):
            module.SummaryWriter = None  # GlobalState only builds one when tensorboard_dir is set
        return module

    def exec_module(self, module):
        pass


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


@contextlib.contextmanager
def _import_stubs():
    """Stub the optional packages Bridge's training modules import but this machine lacks."""
    # megatron.core's dist_checkpointing probes nvidia_resiliency_ext in try/except: import it
    # first so that it sees the real absence, not the stub.
    importlib.import_module("megatron.core.dist_checkpointing.strategies.torch")
    roots = [name for name in _STUBBED_PACKAGES if _missing(name)]
    if not _importable("torch.utils.tensorboard"):
        roots.append("torch.utils.tensorboard")
    before = set(sys.modules)
    finder = _StubFinder(roots)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in set(sys.modules) - before:
            if isinstance(sys.modules[name], _Stub):
                del sys.modules[name]
                parent, _, child = name.rpartition(".")
                if parent in sys.modules and isinstance(getattr(sys.modules[parent], child, None), _Stub):
                    delattr(sys.modules[parent], child)


@contextlib.contextmanager
def _patched(obj, name, value):
    """Set ``obj.name`` for the duration; restore it (or drop the instance attribute) afterwards."""
    own = name in vars(obj)
    saved = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, saved)
        else:
            delattr(obj, name)


@contextlib.contextmanager
def _helpers_prebuilt():
    """``initialize.compile_helpers`` a no-op where the wheel ships no Makefile (CPU or GPU)."""
    from megatron.bridge.training import initialize
    from megatron.core import datasets

    if os.path.exists(os.path.join(os.path.dirname(datasets.__file__), "Makefile")):
        yield
        return
    with _patched(initialize, "compile_helpers", lambda: None):
        yield


@contextlib.contextmanager
def _cpu_patches():
    """CUDA assumptions of Bridge's setup/train loop and Megatron's DDP/optimizer, on a host."""
    if torch.cuda.is_available():
        yield
        return
    import functools

    from megatron.bridge.training import setup
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from conversion.cpu_shim import HostStream, cuda_calls_on_cpu

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(setup, "initialize_megatron",
                                     functools.partial(setup.initialize_megatron, allow_no_cuda=True)))
        stack.enter_context(_patched(torch.cuda, "synchronize", lambda *a, **k: None))
        stack.enter_context(_patched(torch.cuda, "Stream", HostStream))
        stack.enter_context(_patched(get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext()))
        stack.enter_context(cuda_calls_on_cpu())  # current_device, current_stream, the TorchFunctionMode
        yield


@contextlib.contextmanager
def _env(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _config(hf_config, *, train_iters, tp, dp, lr, overlap_param_gather, seed, micro_batch_size, seq_length):
    from megatron.bridge.training.config import (CheckpointConfig, ConfigContainer, DistributedDataParallelConfig,
                                                 DistributedInitConfig, LoggerConfig, MockGPTDatasetConfig,
                                                 OptimizerConfig, RNGConfig, SchedulerConfig, TrainingConfig,
                                                 ValidationConfig)
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    from megatron_refit.plan.layout import TrainLayout

    from conversion.testing.build import make_provider

    _, provider = make_provider(hf_config, TrainLayout(tp=tp, dp=dp), dtype=torch.bfloat16, pad_vocab=True)
    provider.use_cpu_initialization = not torch.cuda.is_available()  # True keeps the model on the host
    provider.seq_length = seq_length
    overlap = overlap_param_gather
    return ConfigContainer(
        model=provider,
        train=TrainingConfig(train_iters=train_iters, micro_batch_size=micro_batch_size,
                             global_batch_size=micro_batch_size * dp),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        optimizer=OptimizerConfig(optimizer="adam", lr=lr, min_lr=0.0, weight_decay=0.0, clip_grad=1.0,
                                  bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True),
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0, start_weight_decay=0.0,
                                  end_weight_decay=0.0, weight_decay_incr_style="constant"),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                          overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                                          bucket_size=4096 if overlap else None),
        dataset=MockGPTDatasetConfig(seq_length=seq_length, random_seed=seed, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False, num_dataset_builder_threads=1,
                                     split="1,1,1", dataloader_type="single", num_workers=0,
                                     skip_getting_attention_mask_from_dataset=True),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=hf_config.vocab_size - 1),
        checkpoint=CheckpointConfig(save=None, load=None),
        rng=RNGConfig(seed=seed),
        dist=DistributedInitConfig(distributed_backend="nccl" if torch.cuda.is_available() else "gloo"),
        mixed_precision="bf16_mixed",
    )


MOCK_DOCUMENTS = 2000
"""Documents of Megatron's mock dataset (its own default: 100,000, about 13 million samples of 16
tokens, whose shuffle index each rank builds for each split: 2 s of a run's CPU). A few thousand
iterations' worth is plenty for a run of a few."""


def run_tiny_pretrain(hf_config, *, train_iters: int, callbacks: list, tp: int = 1, dp: int = 1,
                        lr: float = 1e-3, overlap_param_gather: bool = False, seed: int = 1234,
                        micro_batch_size: int = 1, seq_length: int = 16) -> dict:
    """Run Bridge's ``pretrain()`` for ``train_iters`` iterations in this (spawned) process,
    on the GPU where there is one (params moved there by Bridge), else on the CPU.

    Rank and world size come from ``RANK``/``WORLD_SIZE``, the rendezvous from
    ``MASTER_ADDR`` (default 127.0.0.1) and ``MASTER_PORT``; the world size must be
    ``tp * dp``. Bridge initialises the gloo process group and destroys it on return (a group
    the caller already initialised is used and left alone).
    ``overlap_param_gather`` also turns on the overlapped grad reduce-scatter (small buckets).
    Returns ``{"iterations", "losses" (lm loss per iteration), "grad_norms", "skipped",
    "seconds"}``.
    """
    from conversion.te_shim import import_bridge

    world = int(os.environ["WORLD_SIZE"])
    if world != tp * dp:
        raise ValueError(f"WORLD_SIZE={world} does not match tp*dp={tp * dp}")
    import_bridge()
    record = {"losses": [], "grad_norms": [], "skipped": []}
    start = time.perf_counter()
    with _import_stubs():
        from megatron.bridge.training.callbacks import Callback
        from megatron.bridge.training.gpt_step import forward_step
        from megatron.bridge.training.pretrain import pretrain

        class _Record(Callback):
            def on_train_step_end(self, context):
                loss = (context.loss_dict or {}).get("lm loss")
                record["losses"].append(None if loss is None else float(loss))
                record["grad_norms"].append(None if context.grad_norm is None else float(context.grad_norm))
                record["skipped"].append(bool(context.skipped_iter))

            def on_train_end(self, context):
                record["iterations"] = context.state.train_state.step  # on_train_step_end sees step - 1

        config = _config(hf_config, train_iters=train_iters, tp=tp, dp=dp, lr=lr,
                         overlap_param_gather=overlap_param_gather, seed=seed,
                         micro_batch_size=micro_batch_size, seq_length=seq_length)
        from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

        with _env(MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                  LOCAL_RANK=os.environ.get("LOCAL_RANK", os.environ["RANK"])), _helpers_prebuilt(), _cpu_patches(), \
                _patched(MockGPTLowLevelDataset, "size", MOCK_DOCUMENTS):
            pretrain(config, forward_step, callbacks=[*callbacks, _Record()])
    record.setdefault("iterations", 0)
    record["seconds"] = time.perf_counter() - start
    return record
