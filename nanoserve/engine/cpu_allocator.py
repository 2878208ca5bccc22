"""Which malloc serves this process's CPU tensors, and why it matters for a CPU engine's speed.

torch takes a CPU tensor's memory from the C library's malloc. glibc's malloc hands a block larger
than its mmap threshold (at most 32 MB on 64-bit Linux) straight from the operating system, and
gives it back when the tensor is freed; the next step's tensor of the same size then lands on fresh
pages, and the OS zeroes each 4 KiB page on its first touch. A step's logits are such a tensor once
the batch is large: 256 rows × a 50,257-token vocabulary × 4 bytes = 51 MB. tcmalloc keeps freed
memory for the next request, and on the 2-core machine of benchmarks/RESULTS.md it took a large
share off that LM head GEMM and a visible one off the whole decode step (the figures are there).
(The torch backend's gather hit the same wall, which is why the KV cache keeps its gather
workspace.)

An allocator is chosen when the process starts
(`LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4`), not by a library inside it, so
the engine only says so once, in the log; vLLM's CPU backend asks for tcmalloc the same way, and
torch's CPU launcher (`python -m torch.backends.xeon.run_cpu`) preloads jemalloc or tcmalloc.

Huge pages. A decode step at one row reads every weight once (GPT-2 6 × 384: 120 MB per token), and
on 4 KiB pages that is ~30,000 pages a token, each a TLB miss and a page-table walk. With the
kernel's transparent huge pages in `madvise` mode (the usual default), torch puts a CPU tensor of ≥
2 MB on 2 MB pages when THP_MEM_ALLOC_ENABLE=1 — weights, oneDNN's packed copies, the KV pool. torch
reads the variable at its first allocation, so nanoserve sets it on import (unless the process set
it already); measured on the 2-core Xeon of RESULTS.md ("Fifth step"), the single-stream step ran
faster with it in 5 of 5 paired runs (by 3–19 %, fastest runs). `huge_page_bytes` says how much of
this process has them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("nanoserve")
_ADVISED = False


def malloc_library() -> str:
    """"tcmalloc" or "jemalloc" when one is loaded into this process (Linux: /proc/self/maps), else
    "glibc" (or "unknown" where the process map cannot be read)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "glibc"


def thp_mode() -> str:
    """The kernel's transparent huge pages setting: "always", "madvise" (huge pages where a program
    asks, as torch does with THP_MEM_ALLOC_ENABLE=1), "never", or "unknown" (not Linux, or not
    readable)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else "unknown"


def huge_page_bytes() -> int | None:
    """Bytes of this process's memory on transparent huge pages (/proc/self/smaps_rollup), None
    where unknown."""
    try:
        rollup = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return None
    kb = [int(line.split()[1]) for line in rollup.splitlines() if line.startswith("AnonHugePages:")]
    return kb[0] * 1024 if kb else None


def advise_on_allocator(largest_weight_bytes: int = 0) -> None:
    """Log once per process, at INFO, that a CPU engine under glibc's malloc pays page faults on big
    tensors, and that its weights (the largest `largest_weight_bytes` long) sit on 4 KiB pages where
    the kernel could give it huge ones."""
    global _ADVISED
    if _ADVISED:
        return
    _ADVISED = True
    if thp_mode() in ("always",
                      "madvise") and largest_weight_bytes >= 4 << 20 and huge_page_bytes() == 0:
        logger.info("the weights sit on 4 KiB pages: THP_MEM_ALLOC_ENABLE=%r, or a tensor was "
                    "made before nanoserve was imported. Set THP_MEM_ALLOC_ENABLE=1 before "
                    "torch's first tensor for 2 MB pages "
                    "(nanoserve/engine/cpu_allocator.py)", os.environ.get("THP_MEM_ALLOC_ENABLE"))
    if malloc_library() == "glibc":
        logger.info("CPU tensors come from glibc's malloc, which returns blocks over 32 MB to the "
                    "OS: large batches pay page faults on their logits every step. Preloading "
                    "tcmalloc or jemalloc (LD_PRELOAD) avoids it "
                    "(nanoserve/engine/cpu_allocator.py)")
