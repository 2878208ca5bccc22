"""The core imports no extension; extensions attach at the named points
(nanoserve/extension_points.py).

scripts/core_size.py holds the map (which modules are the core, which are extensions) and reads the
imports of every module the core reaches with Python's own parser: statements at any depth, the
packages Python imports first. These tests run it on the real files, and on copies with one import
added, to show it would see one.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import nanoserve
from nanoserve.errors import ConfigError
from nanoserve.extension_points import POINTS, _registry, extension, register

ROOT = Path(__file__).resolve().parent.parent


def _load_script():
    spec = importlib.util.spec_from_file_location("core_size", ROOT / "scripts" / "core_size.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


core_size = _load_script()


def _with_extra_import(module: str, line: str):
    """A reader of module sources that adds `line` to `module`'s source."""
    def read(name: str) -> str:
        text = core_size.module_path(name).read_text()
        return text + "\n" + line + "\n" if name == module else text
    return read


def test_the_core_imports_no_extension():
    assert core_size.core_to_extension_edges() == set()


@pytest.mark.parametrize("module, line, edge", [
    # a direct import, relative, inside a function: found
    ("nanoserve.engine.sampler", "def f():\n    from ..spec import spec_decode",
     ("nanoserve.engine.sampler", "nanoserve.spec.spec_decode")),
    # an absolute import of a module the core reaches only through a support module: found there
    ("nanoserve.models.hf_fields", "import nanoserve.quant.online",
     ("nanoserve.models.hf_fields", "nanoserve.quant.online")),
    # `from package import module`
    ("nanoserve.engine.scheduler", "from ..engine import cuda_graph",
     ("nanoserve.engine.scheduler", "nanoserve.engine.cuda_graph")),
])
def test_an_added_import_of_an_extension_is_found(module, line, edge):  # the control
    assert edge in core_size.core_to_extension_edges(_with_extra_import(module, line))


def test_a_parent_package_counts():  # importing kv.cache runs kv/__init__.py first
    read = _with_extra_import("nanoserve.kv", "from .triton_backend import TritonCacheView")
    assert ("nanoserve.kv",
            "nanoserve.kv.triton_backend") in core_size.core_to_extension_edges(read)


def test_the_map_names_real_modules_and_places_every_module():
    for module, _ in core_size.CORE:
        assert core_size.module_path(module) is not None, module
    for prefix in core_size.EXTENSIONS + core_size.SUPPORT:
        if prefix != "nanoserve.kernels":  # installed from the top-level kernels/ folder
            assert core_size.module_path(prefix) is not None, prefix
    core = {m for m, _ in core_size.CORE} | {"nanoserve.engine", "nanoserve.kv", "nanoserve.models"}
    front = {"nanoserve", "nanoserve.__main__", "nanoserve.cli"}  # the façade and the command
    placed = core | front
    for path in core_size.package_files():
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        known = module in placed or core_size.is_extension(module) or any(
            module == s or module.startswith(s + ".") for s in core_size.SUPPORT)
        assert known, f"{module} is neither core, support nor extension in scripts/core_size.py"


def test_every_extension_point_is_filled_by_import_nanoserve():
    assert nanoserve.extensions is not None
    assert set(_registry) == set(POINTS)


def test_an_unknown_or_empty_point_is_an_error_that_names_it(monkeypatch):
    with pytest.raises(ConfigError, match="no extension point 'speculation'; the points are"):
        register("speculation", object())
    monkeypatch.delitem(_registry, "lora")
    with pytest.raises(ConfigError, match="nothing is registered at the extension point 'lora'"):
        extension("lora")


def test_the_core_size_report_runs():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "core_size.py")],
                         capture_output=True,
                         text=True, check=True).stdout
    assert "nanoserve/engine/llm_engine.py" in out
    assert "imports from the core into an extension: 0" in out


def test_architecture_md_holds_the_current_reading_order():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert core_size.reading_order_block() in text, "run: python scripts/core_size.py --write-docs"
