"""The extensions nanoserve ships, attached to the core's extension points.

The core names no extension (extension_points.py lists the points and what the core calls
at each); this file is the one place that connects the two. `import nanoserve` runs it, so every
engine made after that finds its extensions. A new extension registers itself here the same way.
"""

from types import SimpleNamespace

from . import lora
from .engine import async_step, cpu_allocator, cuda_graph, kv_eviction, structured_output
from .extension_points import register
from .kv import in_place
from .kv import quant as kv_quant
from .models import families, gguf_file, onednn, triton_layers
from .parallel import workers
from .quant import load, online
from .sparsity import checkpoint as sparse_checkpoint
from .spec import spec_decode, tree_sampler

register("quantization", SimpleNamespace(  # quantized checkpoints; 8-bit linears made as one loads
    quantized_layers=load.quantized_layers, install_quant_linears=load.install_quant_linears,
    quantize_on_load=online.quantize_on_load))
register("attention_backends", in_place)  # Triton's kernels, the CPU's C decode kernel
register("kv_quant", kv_quant)  # K/V stored in 8 bits, a scale per token and head
register("gguf", gguf_file)  # llama.cpp's GGUF files: packed linears, memory-mapped
register("parallel", workers)  # the model split over ranks, rank 0 driving the others
register("lora", lora)  # adapters: merged at load, or one per request
register("speculative", spec_decode)  # drafts proposed before a forward, verified after it
register("token_trees", tree_sampler)  # Medusa's trees: positions and masks of a token tree
register("structured_outputs", structured_output)  # grammars compiled, masks per row
register("async_scheduling", async_step)  # each step launched before the last one's tokens are in
register("cuda_graphs", cuda_graph)  # decode steps replayed from recorded graphs
register("triton_layers", triton_layers)  # fused Llama layers: one kernel where torch has several
register("cpu_runtime", SimpleNamespace(  # CPU GEMMs through oneDNN; malloc and huge pages
    use_onednn_linears=onednn.use_onednn_linears,
    advise_on_allocator=cpu_allocator.advise_on_allocator))
register("sparsity", sparse_checkpoint)  # pruned checkpoints: a 2:4 claim checked on load
register("kv_eviction", kv_eviction)  # StreamingLLM and SnapKV: blocks a request gives back
register("model_families", families)  # families of a module of their own (models/family.py)
