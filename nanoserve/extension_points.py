"""Where extensions attach to the core: a registry of named extension points.

The core (the files notebooks 00-03 build: scripts/core_size.py lists them) never imports an
extension; tests/test_layering.py checks it. Where the core can use one, it asks this registry for
the module registered under the point's name and calls that module's documented functions.
nanoserve/extensions.py registers every extension nanoserve ships, and `import nanoserve` runs it
before anything else can make an engine.

    point               registered (nanoserve/...)    what the core calls, and where
    quantization        quant/load.py, online.py      quantized_layers, install_quant_linears:
                                                      the loader, for a quantized checkpoint;
                                                      quantize_on_load: LLMEngine, 8-bit linears
    parallel            parallel/workers.py           pin_rank_device, start_workers, make_runner:
                                                      LLMEngine, when the model spans several ranks
    lora                lora/__init__.py              LoRAManager: LLMEngine (per-request adapters);
                                                      load_lora_adapter, merge_lora, apply_lora: LLM
    speculative         spec/spec_decode.py           build_spec_decoder(config, engine): LLMEngine;
                                                      its SpecDecoder drafts before each forward and
                                                      verifies after it
    token_trees         spec/tree_sampler.py          tree_positions, tree_mask,
                                                      packed_ancestor_bits: ModelRunner.prepare
                                                      (Medusa's token trees)
    structured_outputs  engine/structured_output.py   GrammarCompiler: InputProcessor compiles a
                                                      request's grammar; the engine asks it
                                                      for masks
    async_scheduling    engine/async_step.py          OverlappedStep: LLMEngine.step, with
                                                      async_scheduling (its ModelRunner reads
                                                      the tokens in flight: late_tokens)
    cuda_graphs         engine/cuda_graph.py          CudaGraphRunner: ModelRunner.use_cuda_graphs
    triton_layers       models/triton_layers.py       use_triton_layers: ModelRunner, with the
                                                      triton attention backend (fused Llama
                                                      layers, RMSNorm as one kernel)
    cpu_runtime         models/onednn.py,             use_onednn_linears, advise_on_allocator:
                        engine/cpu_allocator.py       ModelRunner, on the CPU
    attention_backends  kv/in_place.py                VIEWS, in_place_problem: PagedKVCache
                                                      (Triton and C kernels; each view builds its
                                                      own metadata)
    kv_quant            kv/quant.py                   kv_quant, kv_element_bytes: PagedKVCache,
                                                      K/V stored in 8 or 4 bits
    gguf                models/gguf_file.py           read_gguf: the loader, for a GGUF file
                                                      (config, float tensors, packed linears)
    kv_eviction         engine/kv_eviction.py         admit: LLMEngine (a request's KV eviction
                                                      policy checked; on first use the step hook
                                                      that picks the blocks each step gives back)
    sparsity            sparsity/checkpoint.py        check_sparse_model: the loader, for a
                                                      pruned checkpoint (its 2:4 claim checked)
    model_families      models/families/              FAMILIES: hf_config, the loader and
                                                      build_model, for the families of a module
                                                      of their own (models/family.py)

An extension point that nothing registered is an error that names it.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

from .errors import ConfigError

POINTS = ("quantization", "parallel", "lora", "speculative", "token_trees", "structured_outputs",
          "async_scheduling", "cuda_graphs", "triton_layers", "cpu_runtime", "attention_backends",
          "kv_quant", "gguf", "sparsity", "kv_eviction", "model_families")

_registry: dict[str, ModuleType | SimpleNamespace] = {}


def register(point: str, module: ModuleType | SimpleNamespace) -> None:
    """Attach `module` at `point` (one of POINTS); a later registration replaces an earlier one."""
    if point not in POINTS:
        raise ConfigError(f"no extension point {point!r}; the points are {', '.join(POINTS)}")
    _registry[point] = module


def extension(point: str) -> ModuleType | SimpleNamespace:
    """The module registered at `point`."""
    if point not in _registry:
        raise ConfigError(f"nothing is registered at the extension point {point!r} "
                          "(nanoserve/extensions.py registers the extensions; import nanoserve)")
    return _registry[point]
