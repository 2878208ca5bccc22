"""engine/cpu_allocator.py: which malloc the process runs on, read from its memory map, and the one
log line.

The claim it logs (page faults on big fresh tensors under glibc) is a speed figure, measured in
benchmarks/RESULTS.md, not here: tests never depend on speed. What is tested is the detection, with
a negative control (the same process without the preload reads glibc), and that the advice is given
once.
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


@pytest.mark.skipif(not glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4"),
                    reason="no tcmalloc on this machine")
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


HUGE = ("import nanoserve, torch; from nanoserve.engine.cpu_allocator import huge_page_bytes; "
        "x = torch.ones(64 << 20); print(huge_page_bytes())")


@pytest.mark.skipif(cpu_allocator.thp_mode() not in ("always",
                                                     "madvise") or cpu_allocator.huge_page_bytes() is None,
                    reason="no transparent huge pages to ask for on this machine")
def test_importing_nanoserve_puts_big_cpu_tensors_on_huge_pages():
    """nanoserve sets THP_MEM_ALLOC_ENABLE=1 on import (unless set): a 256 MB tensor made after
    lands on 2 MB pages; control: a process that set it to 0 keeps 4 KiB pages (in `madvise` mode
    nothing else asks)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    run = lambda extra: int(subprocess.run([sys.executable, "-c", HUGE], capture_output=True, text=True,  # noqa: E731
                                           env={**env, **extra}, check=True).stdout.split()[-1])
    # asked outright and given none: the machine's doing
    if run({"THP_MEM_ALLOC_ENABLE": "1"}) == 0:
        pytest.skip("the kernel gave no transparent huge page to a process that asked for them "
                    "(its memory too fragmented, or a container's limit): nothing here to tell "
                    "the setting by")
    assert run({}) >= 2 << 20
    if cpu_allocator.thp_mode() == "madvise":
        assert run({"THP_MEM_ALLOC_ENABLE": "0"}) == 0


def test_the_huge_page_advice_names_the_setting(monkeypatch, caplog):
    monkeypatch.setattr(cpu_allocator, "malloc_library", lambda: "tcmalloc")
    monkeypatch.setattr(cpu_allocator, "thp_mode", lambda: "madvise")
    for pages, largest, said in ((0, 8 << 20, True), (4 << 20, 8 << 20, False),
                                 (0, 1 << 20, False)):
        monkeypatch.setattr(cpu_allocator, "_ADVISED", False)
        monkeypatch.setattr(cpu_allocator, "huge_page_bytes", lambda p=pages: p)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="nanoserve"):
            cpu_allocator.advise_on_allocator(largest)
        assert any("THP_MEM_ALLOC_ENABLE" in r.message for r in caplog.records) == said
