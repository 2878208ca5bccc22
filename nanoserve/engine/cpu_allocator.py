"""Which malloc serves this process's CPU tensors, and why it matters for a CPU engine's speed.

torch takes a CPU tensor's memory from the C library's malloc. glibc's malloc hands a block larger
than its mmap threshold (at most 32 MB on 64-bit Linux) straight from the operating system, and
gives it back when the tensor is freed; the next step's tensor of the same size then lands on fresh
pages, and the OS zeroes each 4 KiB page on its first touch. A step's logits are such a tensor once
the batch is large: 256 rows × a 50,257-token vocabulary × 4 bytes = 51 MB. Measured on the 2-core
machine of benchmarks/RESULTS.md, that LM head GEMM took 37 ms with glibc and 22 ms with tcmalloc,
which keeps freed memory for the next request; a whole 256-row decode step, 102 → 81 ms. (The torch
backend's gather hit the same wall, which is why the KV cache keeps its gather workspace.)

An allocator is chosen when the process starts (`LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4`),
not by a library inside it, so the engine only says so once, in the log; vLLM's CPU backend asks for
tcmalloc the same way, and torch's CPU launcher (`python -m torch.backends.xeon.run_cpu`) preloads
jemalloc or tcmalloc.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger("nanoserve")
_ADVISED = False


def malloc_library() -> str:
    """"tcmalloc" or "jemalloc" when one is loaded into this process (Linux: /proc/self/maps), else "glibc"
    (or "unknown" where the process map cannot be read)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "glibc"


def advise_on_allocator() -> None:
    """Log once per process, at INFO, that a CPU engine under glibc's malloc pays page faults on big tensors."""
    global _ADVISED
    if _ADVISED:
        return
    _ADVISED = True
    if malloc_library() == "glibc":
        logger.info("CPU tensors come from glibc's malloc, which returns blocks over 32 MB to the OS: large "
                    "batches pay page faults on their logits every step. Preloading tcmalloc or jemalloc "
                    "(LD_PRELOAD) avoids it (nanoserve/engine/cpu_allocator.py)")
