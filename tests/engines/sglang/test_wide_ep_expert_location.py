"""``megatron_refit.plan.expert_placement`` against SGLang 0.5.23's own ``ExpertLocationMetadata``
(``srt/eplb/expert_location.py``), built as a server builds it: the published ``ServerArgs``
(``ep_size``, ``ep_num_redundant_experts``) and a ``ModelConfig`` of a small Qwen3-MoE. Its
trivial map (``init_trivial``) and a permuted per-layer map (``init_by_mapping``, as
``--init-expert-location`` gives one) against :func:`initial_map`, :func:`slots_of` (the rank
chunks SGLang's ``format_physical_to_logical_map`` prints) and :func:`ranks_holding` (the
replicas ``logical_to_all_physical`` hands the weight loader, on the ranks SGLang computes)."""

from __future__ import annotations

import importlib.util
import json
import random
import re

import pytest

from megatron_refit.plan.expert_placement import initial_map, ranks_holding, sglang_placement, slots_of

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs SGLang (make setup-sglang: .venv-sglang)", allow_module_level=True)

NUM_LAYERS = 3
NUM_LOGICAL = (8, 16, 64)
EP_SIZES = (1, 2, 3, 4, 8)
NUM_REDUNDANT = (0, 2, 8)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A Qwen3-MoE ``config.json`` per expert count (SGLang reads the experts and layers from it)."""
    from transformers import Qwen3MoeConfig

    dirs = {}
    for num_logical in NUM_LOGICAL:
        path = tmp_path_factory.mktemp(f"qwen3moe-e{num_logical}")
        config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                num_hidden_layers=NUM_LAYERS, num_attention_heads=2, num_key_value_heads=1,
                                head_dim=8, num_experts=num_logical, num_experts_per_tok=2,
                                architectures=["Qwen3MoeForCausalLM"])
        (path / "config.json").write_text(json.dumps(config.to_dict()))
        dirs[num_logical] = str(path)
    return dirs


@pytest.fixture
def deploy():
    """``deploy(model_dir, ep_size, num_redundant)``: SGLang's server args published for this
    process, and the ``ModelConfig``; the context is reset after the test."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    def make(model_dir, ep_size, num_redundant):
        reset_context()
        publish(ServerArgs(model_path=model_dir, device="cpu", tp_size=ep_size, ep_size=ep_size,
                           ep_num_redundant_experts=num_redundant, dtype="float32", load_format="dummy",
                           skip_tokenizer_init=True), role="test", ranks=SpawnRanks(world_rank=0))
        return ModelConfig(model_dir, dtype="float32")

    yield make
    reset_context()


def _rank_chunks(metadata):
    """``{layer: [slots' logical experts per rank]}`` as SGLang's own layout printout gives them."""
    from sglang.srt.eplb.expert_location import format_expert_location_layout

    chunks = {}
    for line in format_expert_location_layout(metadata).splitlines()[1:]:
        layer = int(re.match(r"layer=(\d+):", line).group(1))
        chunks[layer] = [json.loads(m) for m in re.findall(r"ep\d+=(\[[^\]]*\])", line)]
    return chunks


def _check(placement, metadata):
    from sglang.srt.eplb.expert_location import _compute_gpu_id_of_physical_expert

    assert metadata.ep_size == placement.ep_size
    assert metadata.num_local_physical_experts * placement.ep_size == placement.num_physical
    chunks = _rank_chunks(metadata)
    for layer in range(NUM_LAYERS):
        assert tuple(metadata.physical_to_logical_map_cpu[layer].tolist()) == placement.layer_map(layer)
        for rank in range(placement.ep_size):
            assert [logical for _, logical in slots_of(placement, rank, layer)] == chunks[layer][rank]
        for logical in range(placement.num_logical_experts):
            replicas = metadata.logical_to_all_physical(layer, logical)
            assert sorted(replicas) == [p for p, e in enumerate(placement.layer_map(layer)) if e == logical]
            ranks = {_compute_gpu_id_of_physical_expert(p, metadata.num_local_physical_experts) for p in replicas}
            assert ranks_holding(placement, layer, logical) == tuple(sorted(ranks))


@pytest.mark.parametrize("num_logical", NUM_LOGICAL)
@pytest.mark.parametrize("ep_size", EP_SIZES)
def test_trivial_and_permuted_maps_are_sglangs(model_dirs, deploy, num_logical, ep_size):
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    rng = random.Random(num_logical * 10 + ep_size)
    for num_redundant in NUM_REDUNDANT:
        model_config = deploy(model_dirs[num_logical], ep_size, num_redundant)
        num_physical = num_logical + num_redundant
        if num_physical % ep_size:
            with pytest.raises(AssertionError):  # SGLang's _init_common: num_physical_experts % ep_size == 0
                ExpertLocationMetadata.init_trivial(model_config, moe_ep_rank=0)
            with pytest.raises(ValueError, match=f"ep_size={ep_size} does not divide the {num_physical} physical"):
                sglang_placement(num_logical_experts=num_logical, ep_size=ep_size, num_redundant=num_redundant)
            continue
        trivial = ExpertLocationMetadata.init_trivial(model_config, moe_ep_rank=0)
        assert trivial.physical_to_logical_map_cpu.tolist() == [list(initial_map(num_logical, num_redundant))] * \
            NUM_LAYERS
        _check(sglang_placement(num_logical_experts=num_logical, ep_size=ep_size, num_redundant=num_redundant),
               trivial)

        rows = []
        for _ in range(NUM_LAYERS):  # every expert once, the redundant slots anywhere, shuffled
            row = list(range(num_logical)) + [rng.randrange(num_logical) for _ in range(num_redundant)]
            rng.shuffle(row)
            rows.append(tuple(row))
        moved = ExpertLocationMetadata.init_by_mapping(model_config, physical_to_logical_map=[list(r) for r in rows],
                                                       moe_ep_rank=0)
        _check(sglang_placement(num_logical_experts=num_logical, ep_size=ep_size, num_redundant=num_redundant,
                                physical_to_logical=tuple(rows)), moved)


def test_two_replicas_on_one_rank(model_dirs, deploy):
    """Logical expert 0 twice on rank 0 and logical expert 1 twice on rank 1: every replica listed."""
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    model_config = deploy(model_dirs[8], 2, 2)
    rows = ((0, 2, 3, 0, 4), (5, 6, 7, 1, 1))
    row = rows[0] + rows[1]
    metadata = ExpertLocationMetadata.init_by_mapping(model_config, physical_to_logical_map=[list(row)] * NUM_LAYERS,
                                                      moe_ep_rank=0)
    placement = sglang_placement(num_logical_experts=8, ep_size=2, num_redundant=2,
                                 physical_to_logical=(row,) * NUM_LAYERS)
    _check(placement, metadata)
    assert [local for local, logical in slots_of(placement, 0, 1) if logical == 0] == [0, 3]
    assert [local for local, logical in slots_of(placement, 1, 2) if logical == 1] == [3, 4]
