"""EngineConfig (nanoserve/config/): flat keyword arguments sorted into one validated dataclass
per concern, the same table behind LLM(...), LLMEngine.from_kwargs and the `nanoserve` command."""

from __future__ import annotations

import dataclasses

import pytest

from nanoserve import LLM, LLMEngine
from nanoserve.cli import build_parser, engine_kwargs
from nanoserve.config import (
    ENGINE_ARGS,
    SECTION_TYPES,
    CacheConfig,
    EngineConfig,
    GrammarLimits,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from nanoserve.errors import ConfigError, NanoserveError


def test_each_keyword_lands_in_its_section():
    cfg = EngineConfig.from_kwargs("demo", max_num_seqs=8, block_size=32, kv_cache_dtype="int8",
                                   tensor_parallel_size=1, enable_lora=True, max_lora_rank=8,
                                   speculative="ngram", num_speculative_tokens=3,
                                   grammar_max_bytes=1024)
    assert cfg.model == "demo"
    assert cfg.scheduler == SchedulerConfig(max_num_seqs=8)
    assert cfg.cache == CacheConfig(block_size=32, kv_cache_dtype="int8")
    assert cfg.lora == LoRAConfig(max_lora_rank=8)
    assert cfg.speculative == SpeculativeConfig("ngram", num_speculative_tokens=3)
    assert cfg.structured_outputs == GrammarLimits(max_bytes=1024)
    plain = EngineConfig.from_kwargs("demo")
    assert plain.speculative is None and plain.lora is None  # off unless asked for


def test_the_table_names_real_fields():
    for name, arg in ENGINE_ARGS.items():
        names = {f.name for f in dataclasses.fields(SECTION_TYPES[arg.section])}
        assert arg.field in names | {"enabled", "whole"}, name


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_num_seq=4), r"unknown engine argument 'max_num_seq'; did you mean max_num_seqs\?"),
    (dict(enable_prefix_cache=False), r"did you mean enable_prefix_caching"),
    (dict(gpu_memory_utilization=0.9), r"unknown engine argument 'gpu_memory_utilization' \(all"),
])
def test_an_unknown_keyword_is_refused_with_the_closest_names(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_kwargs("demo", **kwargs)
    with pytest.raises(ConfigError, match=match):  # LLM builds the same config, before loading
        LLM("demo", **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_speculative_tokens=3), r"num_speculative_tokens needs speculative=<method>"),
    (dict(speculative_tree="default"), r"speculative_tree needs speculative=<method>"),
    (dict(max_loras=2), r"max_loras needs enable_lora=True"),
    (dict(enable_lora="yes"), r"enable_lora='yes' must be True or False"),
    (dict(block_size=24), r"block_size=24 is not allowed; it must be a power of two"),
    (dict(max_num_seqs=0), r"max_num_seqs=0 must be an integer ≥ 1"),
    (dict(max_waiting=0), r"max_waiting=0 must be an integer ≥ 1 or None"),
    (dict(kv_cache_dtype="int2"), r"kv_cache_dtype='int2'; allowed: auto, int8, fp8_e4m3"),
    (dict(attention_backend="flash"), r"attention_backend='flash'; allowed: None .*torch, triton"),
    (dict(quantization="int4"), r"quantization='int4'; allowed: None .*fp8"),
    (dict(tensor_parallel_size=2, pipeline_parallel_size=2), r"one kind of split at a time"),
    (dict(tensor_parallel_size=2, speculative="ngram"),
     r"speculative decoding is not supported with"),
    (dict(pipeline_parallel_size=2, enable_lora=True), r"enable_lora is not supported with"),
    (dict(grammar_limits={"max_bytes": 1}), r"grammar_limits must be a GrammarLimits, got dict"),
])
def test_a_bad_setting_is_refused_by_name_before_any_model_loads(kwargs, match):
    with pytest.raises(NanoserveError, match=match):
        EngineConfig.from_kwargs("/nonexistent/checkpoint", **kwargs)  # (loading it would fail too)


def test_a_section_of_the_wrong_type_is_refused():
    with pytest.raises(ConfigError,
                       match="EngineConfig.scheduler must be a SchedulerConfig, got dict"):
        EngineConfig(scheduler={"max_num_seqs": 4})


def test_the_engine_takes_a_config_and_says_how_to_build_one():
    with pytest.raises(ConfigError, match=r"LLMEngine takes an EngineConfig, got str; "
                                          r"LLMEngine.from_kwargs\(model, \*\*kwargs\)"):
        LLMEngine("demo")
    engine = LLMEngine(EngineConfig.from_kwargs("demo", max_num_seqs=3, num_blocks=40))
    assert engine.scheduler.config.max_num_seqs == 3
    assert engine.block_allocator.num_blocks == 40
    assert engine.engine_config.cache.num_blocks == 40


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"]])
def test_the_command_line_offers_every_engine_argument(command):
    parser = build_parser()
    args = parser.parse_args(command)
    assert engine_kwargs(args) == {}  # nothing given: every section at its default
    for name, arg in ENGINE_ARGS.items():
        assert hasattr(args, name) == arg.cli, name


def test_the_command_line_builds_the_same_config_as_keywords():
    argv = ["serve", "--max-num-seqs", "8", "--no-enable-prefix-caching", "--kv-cache-dtype", "int8",
            "--speculative", "ngram", "--num-speculative-tokens", "3", "--speculative-cost", "0.5",
            "--enable-lora", "--max-loras", "2", "--grammar-mask-budget-ms", "50"]
    kwargs = engine_kwargs(build_parser().parse_args(argv))
    assert kwargs == dict(max_num_seqs=8, enable_prefix_caching=False, kv_cache_dtype="int8",
                          speculative="ngram", num_speculative_tokens=3, speculative_cost=0.5,
                          enable_lora=True, max_loras=2, grammar_mask_budget_ms=50.0)
    cfg = EngineConfig.from_kwargs("demo", **kwargs)
    assert cfg.cache.enable_prefix_caching is False and cfg.lora.max_loras == 2
    assert cfg.structured_outputs.mask_budget_ms == 50.0
    with pytest.raises(SystemExit):  # argparse refuses a value outside the choices, naming them
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int2"])
