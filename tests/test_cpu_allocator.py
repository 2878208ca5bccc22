"""engine/cpu_allocator.py: which malloc the process runs on, read from its memory map, and the one log line.

The claim it logs (page faults on big fresh tensors under glibc) is a speed figure, measured in
benchmarks/RESULTS.md, not here: tests never depend on speed. What is tested is the detection, with a
negative control (the same process without the preload reads glibc), and that the advice is given once.
"""

from __future__ import annotations

import glob
import logging
import subprocess
import sys

import pytest

from nanoserve.engine import cpu_allocator

PROBE = "from nanoserve.engine.cpu_allocator import malloc_library; print(malloc_library())"


def _probe(env_extra: dict) -> str:
    import os

    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()


def test_glibc_without_a_preload():
    assert _probe({"LD_PRELOAD": ""}) == "glibc"


@pytest.mark.skipif(not glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4"), reason="no tcmalloc on this machine")
def test_tcmalloc_when_preloaded():
    assert _probe({"LD_PRELOAD": glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4")[0]}) == "tcmalloc"


def test_the_advice_is_logged_once_and_only_under_glibc(monkeypatch, caplog):
    monkeypatch.setattr(cpu_allocator, "_ADVISED", False)
    monkeypatch.setattr(cpu_allocator, "malloc_library", lambda: "glibc")
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        cpu_allocator.advise_on_allocator()
        cpu_allocator.advise_on_allocator()
    assert sum("Preloading tcmalloc or jemalloc" in r.message for r in caplog.records) == 1
    monkeypatch.setattr(cpu_allocator, "_ADVISED", False)
    monkeypatch.setattr(cpu_allocator, "malloc_library", lambda: "tcmalloc")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        cpu_allocator.advise_on_allocator()
    assert not caplog.records
