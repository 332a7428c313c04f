"""megatron.bridge imports without Transformer Engine; the stand-in reaches one importer only."""

from __future__ import annotations

import pytest

from megatron_refit.local.launch import run_spawned


def _import_report(rank, world_size, port):
    import sys

    from conversion.te_shim import import_bridge, te_available

    import_bridge()
    import megatron.bridge.peft.lora_layers as lora_layers
    import megatron.core.extensions.transformer_engine as mcore_te

    try:
        lora_layers.te.Linear()
        refused = False
    except RuntimeError:
        refused = True
    return dict(
        te_available=te_available(),
        te_modules=sorted(k for k in sys.modules if k.split(".")[0] == "transformer_engine"),
        mcore_have_te=mcore_te.HAVE_TE,
        lora_te=type(lora_layers.te).__name__,
        placeholder_refuses=refused,
    )


def test_bridge_imports_and_stand_in_is_scoped():
    report = run_spawned(_import_report, 1, timeout_s=180)[0]
    if report["te_available"]:
        pytest.skip("Transformer Engine is installed: the shim is inactive")
    assert report["te_modules"] == []  # nobody else can import the stand-in
    assert report["mcore_have_te"] is False
    assert report["lora_te"] == "_Inert"
    assert report["placeholder_refuses"]
