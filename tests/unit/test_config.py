"""RefitConfig validation and the refit: section beside Megatron-Bridge's YAML sections."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import yaml

from megatron_refit.config import (
    RefitConfig,
    load_training_yaml,
    split_refit_section,
    train_layout,
)
from megatron_refit.plan.layout import TrainLayout


def test_enabled_only_gives_defaults():
    config = RefitConfig.from_dict({"enabled": True})
    assert config == RefitConfig(enabled=True)
    assert (config.mode, config.engine, config.gen_tp, config.gen_dp, config.lora_sync) == (
        "disaggregated", "vllm", 1, 1, "auto")
    assert config.bucket_bytes == 64 << 20
    assert RefitConfig.from_dict(None).enabled is False


@pytest.mark.parametrize(
    "section, match",
    [
        ({"enabled": True, "bucket_size": 4}, r"unknown key\(s\) \['bucket_size'\]"),
        ({"mode": "shared"}, r"refit.mode: 'shared' is not one of \['disaggregated', 'colocated'\]"),
        ({"engine": "trtllm"}, r"refit.engine: 'trtllm'"),
        ({"lora_sync": "delta"}, r"refit.lora_sync: 'delta'"),
        ({"enabled": "yes"}, r"refit.enabled: expected bool, got 'yes'"),
        ({"gen_tp": 2.0}, r"refit.gen_tp: expected int, got 2.0"),
        ({"gen_dp": True}, r"refit.gen_dp: expected int, got True"),
        ({"bucket_mb": "64"}, r"refit.bucket_mb: expected float, got '64'"),
        ({"bucket_mb": 0}, r"refit.bucket_mb must be positive, got 0"),
        ({"gen_tp": -1}, r"refit.gen_tp must be positive, got -1"),
        ({"timeout_s": 0.0}, r"refit.timeout_s must be positive"),
        ({"port": 70000}, r"refit.port must be at most 65535"),
        ({"engine": "hf", "gen_tp": 2}, r"engine 'hf' .* needs gen_tp 1"),
        ({"model": 3}, r"refit.model: expected str or null, got 3"),
        ([1, 2], r"refit: expected a mapping, got list"),
    ],
)
@pytest.mark.reliability
def test_bad_values_are_named(section, match):
    with pytest.raises(ValueError, match=match):
        RefitConfig.from_dict(section)


def test_settings_of_a_disabled_refit_warn():
    with pytest.warns(UserWarning, match=r"refit.enabled is false: \['gen_tp'\] are ignored"):
        RefitConfig.from_dict({"gen_tp": 2})


def test_every_field_has_a_docstring():
    with open(sys.modules[RefitConfig.__module__].__file__) as f:
        source = f.read()
    for field in dataclasses.fields(RefitConfig):
        head = source.split(f"\n    {field.name}: ", 1)[1].split("\n", 2)
        assert head[1].strip().startswith('"""'), field.name


BRIDGE_YAML = """
model:
  tensor_model_parallel_size: 4
  pipeline_model_parallel_size: 8
  expert_model_parallel_size: 16
  num_layers_in_first_pipeline_stage: 11
  num_layers_in_last_pipeline_stage: 11
train:
  global_batch_size: 512
optimizer:
  lr: 1.0e-6
refit:
  enabled: true
  gen_tp: 8
  gen_dp: 16
"""


def test_refit_section_beside_bridge_sections(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(BRIDGE_YAML)
    rest, refit = load_training_yaml(str(path))
    assert rest == {key: value for key, value in yaml.safe_load(BRIDGE_YAML).items() if key != "refit"}
    assert refit == RefitConfig(enabled=True, gen_tp=8, gen_dp=16)
    layout = train_layout(rest, refit)
    assert layout == TrainLayout(tp=4, pp=8, ep=16, dp=4, first_stage_layers=11, last_stage_layers=11)
    assert layout.stage_layers(94) == [11, 12, 12, 12, 12, 12, 12, 11]


def test_omegaconf_reads_the_file_the_way_bridge_does(tmp_path):
    """Bridge's process_config_with_overrides merges ``OmegaConf.load(path)``; the dict we
    hand it is the same YAML without ``refit:`` (Bridge would warn on the unknown key)."""
    omegaconf = pytest.importorskip("omegaconf")
    path = tmp_path / "train.yaml"
    path.write_text(BRIDGE_YAML)
    loaded = omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.load(path), resolve=True)
    rest, refit = split_refit_section(loaded)
    assert "refit" not in rest and set(rest) == {"model", "train", "optimizer"}
    assert refit.enabled and refit.gen_dp == 16


def test_train_layout_errors():
    with pytest.raises(ValueError, match=r"model.tensor_model_parallel_size: expected int, got '2'"):
        train_layout({"model": {"tensor_model_parallel_size": "2"}}, RefitConfig())
    with pytest.raises(ValueError, match=r"num_layers=61 does not split over pipeline_model_parallel_size=16 with "
                                         r"num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage = "
                                         r"4 / 2"):
        TrainLayout(pp=16, first_stage_layers=4, last_stage_layers=2).stage_layers(61)
    assert TrainLayout(pp=16, first_stage_layers=3, last_stage_layers=2).stage_layers(61) == [3] + [4] * 14 + [2]
    # default DP: the smallest that fits EP inside TP x DP
    assert train_layout({"model": {"expert_model_parallel_size": 8}}, RefitConfig()).dp == 8
    assert train_layout({"model": {"tensor_model_parallel_size": 4, "expert_model_parallel_size": 16}},
                        RefitConfig()).dp == 4


RECIPE_MODEL = {  # Bridge 0.6.2, deepseek/h100/deepseek_v3.py deepseek_v3_pretrain_1024gpu_h100_bf16_config
    "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 16, "virtual_pipeline_model_parallel_size": None,
    "context_parallel_size": 1, "expert_model_parallel_size": 64, "expert_tensor_parallel_size": 1,
    "sequence_parallel": True, "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.1,
    "account_for_embedding_in_pipeline_split": False, "account_for_loss_in_pipeline_split": False,
    "num_layers_in_first_pipeline_stage": None, "num_layers_in_last_pipeline_stage": None,
    "pipeline_model_parallel_layout": [["embedding"] + ["decoder"] * 4] + [["decoder"] * 4] * 14
    + [["decoder", "mtp", "loss"]], "pipeline_dtype": "bf16", "moe_token_dispatcher_type": "alltoall",
}


def test_every_parallel_key_of_a_recipe_is_honoured():
    layout = train_layout({"model": RECIPE_MODEL}, RefitConfig(train_dp=64))
    assert (layout.tp, layout.pp, layout.ep, layout.etp, layout.cp, layout.vpp) == (2, 16, 64, 1, 1, None)
    assert layout.sequence_parallel and layout.mtp_layers == 1 and len(layout.layout) == 16
    assert layout.world_size == 2048 and layout.mtp_stages() == {(15, 0): 1}
    assert "SP" in layout.describe_keys() and "layout Et*4|t*4|" in layout.describe_keys()
    cp = train_layout({"model": {"tensor_model_parallel_size": 2, "context_parallel_size": 2}}, RefitConfig(train_dp=4))
    assert cp.world_size == 16 and cp.describe() == "TP2xCP2xPP1xDP4"  # CP is in the plan, not dropped
    vpp = train_layout({"model": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}},
                       RefitConfig())
    assert vpp.chunk_layers(36)[0, 1] == range(18, 27)
    # a layout's stage count sets the virtual pipeline size, as Megatron's
    assert train_layout({"model": {"pipeline_model_parallel_size": 2,
                                   "pipeline_model_parallel_layout": "Et*4|t*4|t*4|t*4L"}}, RefitConfig()).vpp == 2
    # CP ranks count towards the ranks that hold every expert
    assert train_layout({"model": {"context_parallel_size": 2, "expert_model_parallel_size": 8}}, RefitConfig()).dp == 4


def test_expert_tensor_parallel_default_is_bridges():
    """Unset ETP: 1 under expert parallelism (Bridge's MoE default), else Megatron's: the TP size."""
    assert train_layout({"model": {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2}},
                        RefitConfig(), num_experts=8).etp == 1
    assert train_layout({"model": {"tensor_model_parallel_size": 2}}, RefitConfig(), num_experts=8).etp == 2
    assert train_layout({"model": {"tensor_model_parallel_size": 2}}, RefitConfig(), num_experts=0).etp == 1


@pytest.mark.parametrize("model, match", [
    ({"context_paralel_size": 2}, r"model.context_paralel_size: unknown key; did you mean 'context_parallel_size'"),
    ({"pipeline_model_parallel_split_rank": 2}, r"model.pipeline_model_parallel_split_rank: a parallel setting the "
                                                r"refit does not know"),
    ({"tensor_parallel_num_weight_shards": 4, "tensor_model_parallel_size": 2},
     r"model.tensor_parallel_num_weight_shards=4: weight shards beyond tensor_model_parallel_size=2"),
    ({"hierarchical_context_parallel_sizes": [2, 2], "context_parallel_size": 2},
     r"hierarchical_context_parallel_sizes=\[2, 2\]: their product must be context_parallel_size=2"),
    ({"mtp_use_repeated_layer": True}, r"model.mtp_use_repeated_layer=True: not supported"),
    ({"sequence_parallel": True}, r"sequence_parallel: true needs tensor_model_parallel_size > 1"),
    ({"sequence_parallel": "yes", "tensor_model_parallel_size": 2}, r"model.sequence_parallel: expected true or false"),
    ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et*3|t*2X"},
     r"pipeline_model_parallel_layout 'Et\*3\|t\*2X': unknown layer character\(s\) \['X'\]"),
    ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|t|tL"},
     r"pipeline_model_parallel_layout: 3 stages do not divide over pipeline_model_parallel_size=2"),
    ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 3,
      "pipeline_model_parallel_layout": "Et|tL"}, r"virtual_pipeline_model_parallel_size=3 conflicts with"),
    ({"pipeline_model_parallel_size": 2, "num_layers_in_first_pipeline_stage": 3,
      "pipeline_model_parallel_layout": "Et|tL"}, r"pipeline_model_parallel_layout cannot be set with"),
    ({"virtual_pipeline_model_parallel_size": 2}, r"virtual_pipeline_model_parallel_size=2 needs "
                                                  r"pipeline_model_parallel_size > 1"),
])
def test_parallel_keys_that_cannot_be_honoured_are_refused_by_name(model, match):
    with pytest.raises(ValueError, match=match):
        train_layout({"model": model}, RefitConfig())


def test_fsdp_is_refused_by_name():
    with pytest.raises(ValueError, match=r"ddp.use_megatron_fsdp: true shards each parameter"):
        train_layout({"model": {}, "ddp": {"use_megatron_fsdp": True}}, RefitConfig())
    assert train_layout({"model": {}, "ddp": {"use_megatron_fsdp": False}}, RefitConfig()).world_size == 1


def test_config_imports_neither_megatron_nor_torch():
    code = ("import sys, megatron_refit.config, megatron_refit.tools.dryrun, megatron_refit.tools.costmodel; "
            "bad = [m for m in ('torch', 'megatron', 'transformers') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_an_engine_process_loads_no_bridge_reader():
    """What an engine process imports (the engine side, SGLang's loader) takes RefitConfig from
    megatron_refit.config without its training-YAML and Bridge-layout readers, which load when a
    trainer asks for them."""
    code = ("import sys, megatron_refit.engine_side.entry, megatron_refit.engines.sglang.worker.loader\n"
            "readers = ('megatron_refit.config.training_yaml', 'megatron_refit.config.bridge_model')\n"
            "print([m for m in readers if m in sys.modules])\n"
            "from megatron_refit.config import load_training_yaml, split_refit_section, train_layout\n"
            "print(sorted(m for m in readers if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", str(sorted(["megatron_refit.config.training_yaml",
                                                             "megatron_refit.config.bridge_model"]))]
    import megatron_refit.config as config

    with pytest.raises(AttributeError, match="module 'megatron_refit.config' has no attribute 'load_training'"):
        config.load_training  # noqa: B018 -- a misspelt reader is an AttributeError, not a None


ENV_YAML = """
model:
  tensor_model_parallel_size: 2
refit:
  enabled: false
  host: ${oc.env:TEST_REFIT_HOST}
  port: ${oc.env:TEST_REFIT_PORT,29600}
  gen_tp: 2
  gen_dp: ${model.tensor_model_parallel_size}
"""


def test_training_yaml_resolves_env_interpolation_and_dotted_overrides(tmp_path, monkeypatch):
    """As Bridge reads its YAML (OmegaConf): ``${oc.env:...}`` (an env value read as YAML where
    the field is a number), references to other keys, dotted overrides from a list of strings."""
    path = tmp_path / "train.yaml"
    path.write_text(ENV_YAML)
    monkeypatch.setenv("TEST_REFIT_HOST", "node-017")
    monkeypatch.setenv("TEST_REFIT_PORT", "29611")
    rest, refit = load_training_yaml(str(path), overrides=["refit.enabled=true", "refit.gen_tp=16",
                                                           "model.tensor_model_parallel_size=4"])
    assert (refit.enabled, refit.host, refit.port, refit.gen_tp, refit.gen_dp) == (True, "node-017", 29611, 16, 4)
    assert rest == {"model": {"tensor_model_parallel_size": 4}}
    monkeypatch.delenv("TEST_REFIT_PORT")
    assert load_training_yaml(str(path), ["refit.enabled=true"])[1].port == 29600  # the default after the comma


@pytest.mark.parametrize("overrides, env, match", [
    (["refit.gen_tp=0"], {"TEST_REFIT_HOST": "h"}, r"refit\.gen_tp must be positive, got 0"),
    (["refit.gen_tpp=2"], {"TEST_REFIT_HOST": "h"}, r"unknown key\(s\) \['gen_tpp'\]"),
    (["refit.gen_tp"], {"TEST_REFIT_HOST": "h"}, r"overrides must be 'dotted.key=value' strings"),
    ([], {"TEST_REFIT_HOST": "h", "TEST_REFIT_PORT": "http"}, r"refit\.port: expected int, got 'http'"),
    ([], {}, r"Environment variable 'TEST_REFIT_HOST' not found.*full_key: refit\.host"),
])
@pytest.mark.reliability
def test_training_yaml_errors_name_the_key(tmp_path, monkeypatch, overrides, env, match):
    path = tmp_path / "train.yaml"
    path.write_text(ENV_YAML)
    for var in ("TEST_REFIT_HOST", "TEST_REFIT_PORT"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        load_training_yaml(str(path), overrides)


@pytest.mark.reliability
def test_a_misspelt_refit_section_is_an_error_not_refit_off():
    with pytest.raises(ValueError, match=r"unknown section 'refti'; did you mean 'refit'"):
        split_refit_section({"model": {}, "refti": {"enabled": True}})
    assert split_refit_section({"model": {}, "optimizer": {}})[1].enabled is False


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "bogus"}, r"refit\.mode: 'bogus' is not one of"),
    ({"bucket_mb": float("nan")}, r"refit\.bucket_mb must be a finite number"),
    ({"timeout_s": float("inf")}, r"refit\.timeout_s must be a finite number"),
    ({"timeout_s": 1e300}, r"refit\.timeout_s must be between"),
    ({"bucket_mb": 1e-9}, r"refit\.bucket_mb must be between"),
    ({"gen_tp": "2"}, r"refit\.gen_tp: expected int"),
    ({"every_n_steps": 0}, r"refit\.every_n_steps must be positive"),
])
@pytest.mark.reliability
def test_direct_construction_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RefitConfig(**kwargs)


def test_the_section_crosses_a_process_boundary_as_one_mapping_and_back():
    """One encoder (``to_wire``: vLLM's ``init_info``, SGLang's ``connect``) and one decoder
    (``from_wire``, where the receiving process parses it): every field comes back, in force."""
    with pytest.warns(UserWarning, match="refit.enabled is false"):  # the trainer's side may be off; the engine's is on
        cfg = RefitConfig.from_dict({"enabled": False, "engine": "sglang", "gen_tp": 2, "bucket_mb": 8, "delta": "on",
                                     "verify_serving": "on", "stall_s": 12.5})
    wire = cfg.to_wire()
    assert json.loads(json.dumps(wire)) == wire  # plain JSON: it passes vLLM's routes and Ray unchanged
    assert RefitConfig.from_wire(json.loads(json.dumps(wire)), "init_info") == dataclasses.replace(cfg, enabled=True)
    with pytest.raises(ValueError, match=r"connect\.refit must be the refit: config section as a mapping, got list"):
        RefitConfig.from_wire([], "connect")
