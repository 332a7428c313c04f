"""What a forkserver imports once so that spawned ranks start warm (``REFIT_SPAWN_PRELOAD``).

Every multi-process test starts 2–10 ranks, and each fresh interpreter imports torch,
transformers and Megatron-Core / Bridge again: 6–7 s of CPU per rank on the 2-core CI
machine, most of a short test's time. With ``REFIT_SPAWN_PRELOAD=megatron_refit.testing.preload``
(``tests/conftest.py`` sets it) :func:`megatron_refit.local.launch.run_spawned` forks ranks
from a forkserver that imported this module once per test session: the same modules, in
the same state, as a rank that imported them itself (Bridge through ``conversion``'s TE
shim, as every rank does). Their import-time warnings are dropped here, once.
"""

from megatron_refit.local.launch import quiet_imports

with quiet_imports():
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from conversion.te_shim import import_bridge

    import_bridge()
    import megatron.bridge.models.conversion.model_bridge  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401

    # this project's own modules that every rank imports (0.4-0.8 s of CPU a rank otherwise:
    # 170 ranks in the Megatron tier alone)
    import conversion.refit  # noqa: F401
    import conversion.testing.build  # noqa: F401
    import megatron_refit.fleet.member  # noqa: F401
    import megatron_refit.fleet.trainer_fleet  # noqa: F401
    import megatron_refit.engine_side.entry  # noqa: F401
    import megatron_refit.refit  # noqa: F401
    import megatron_refit.local.harness  # noqa: F401
