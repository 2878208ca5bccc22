"""Building the C kernels (cpu_paged_attention.c, cpu_packed_gemv.c) once per machine, and loading
them with ctypes.

The C compiler (`$CC`, else `cc`) runs on first use, ~0.2 s: `-O3 -march=native` (the CPU's own
vector width), `-fopenmp` (the library links the OpenMP runtime torch has already loaded), plus
each kernel's own flags. Libraries are kept in `$NANOSERVE_CACHE` (default ~/.cache/nanoserve; a
temporary folder where that is read-only), named by a digest of the source, the flags and the
CPU's feature flags, so an edit or another CPU builds afresh.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

BASE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]


def cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for), so a library never runs on another
    CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    """$NANOSERVE_CACHE/cpu_kernels (default ~/.cache/nanoserve/...), or a folder of the user's in
    the system's temporary directory where that cannot be written (a read-only home in a
    container)."""
    for root in (os.environ.get("NANOSERVE_CACHE") or Path.home() / ".cache" / "nanoserve",
                 Path(tempfile.gettempdir()) / f"nanoserve-{os.getuid()}"):
        folder = Path(root) / "cpu_kernels"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return folder
    raise RuntimeError("no writable folder for the compiled kernel: set NANOSERVE_CACHE to one")


def build_library(source: Path, flags: list[str], stem: str) -> ctypes.CDLL:
    """`source` compiled with BASE_FLAGS + `flags` into a cached library named after `stem`, loaded.
    Raises RuntimeError with the compiler's message when it cannot be built."""
    if platform.system() != "Linux":
        raise RuntimeError(f"the C kernels are built for Linux only, not {platform.system()}")
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler: {compiler!r} is not on PATH (set CC to one)")
    flags = [*BASE_FLAGS, *flags]
    key = hashlib.sha256("\0".join([source.read_text(), compiler, *flags,
                                    cpu_flags()]).encode()).hexdigest()[:16]
    path = cache_dir() / f"{stem}_{key}.so"
    if not path.exists():
        # build aside, then rename: processes may race
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            run = subprocess.run([compiler, *flags, str(source), "-o", str(built)],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(f"building {source.name} failed: "
                                   f"{' '.join([compiler, *flags])}\n{run.stderr}")
            os.replace(built, path)
    return ctypes.CDLL(str(path))
