"""The core and its extensions: which files are which, how large each is, and who imports whom.

    python scripts/core_size.py            the core's files in reading order, with their lines,
                                           then the extensions' share (`make core-size`)
    python scripts/core_size.py --edges    the imports that lead from the core into an extension
                                           (tests/test_layering.py: there are none)
    python scripts/core_size.py --write-docs   the reading-order table in docs/ARCHITECTURE.md

The core is what notebooks 00-03 build: a request goes in, tokens come out, on one device, with the
torch attention backend. Everything else attaches to it (docs/ARCHITECTURE.md). `CORE` below is the
reading order; a line of code is a line that is neither blank nor only a comment.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanoserve"

# (module, what it holds): the order a student reads them in
CORE = [
    ("nanoserve.errors", "the error types, and which faults stop the engine"),
    ("nanoserve.engine.sampling_params", "what a request asks of the sampler"),
    ("nanoserve.engine.sequence", "one sequence: token ids, block table, computed tokens"),
    ("nanoserve.engine.block", "KV blocks, prefix hashes, slots"),
    ("nanoserve.engine.block_allocator", "which blocks a sequence owns; prefix caching"),
    ("nanoserve.engine.scheduler", "which sequences run next, how many tokens each"),
    ("nanoserve.kv.contiguous", "the simplest cache: one tensor per layer (notebook 01)"),
    ("nanoserve.kv.metadata", "the attention metadata of one forward"),
    ("nanoserve.kv.torch_backend", "write K/V into the pool, gather, SDPA"),
    ("nanoserve.kv.cache", "the paged KV pool and its sizing"),
    ("nanoserve.models.config", "a model's architecture, read from config.json"),
    ("nanoserve.models.layers", "attention, MLP, norms, RoPE"),
    ("nanoserve.models.base", "CausalLM: the wrapper every family shares"),
    ("nanoserve.models.gpt2", "GPT-2"),
    ("nanoserve.models.llama", "Llama and its relatives"),
    ("nanoserve.models.loader", "checkpoints into models"),
    ("nanoserve.engine.model_runner", "one batched forward: sequences in, logits out"),
    ("nanoserve.engine.sampler", "logits to tokens"),
    ("nanoserve.engine.bitmask", "allowed-token masks, packed 32 tokens to a word"),
    ("nanoserve.engine.logprobs", "the logprobs a request asked for"),
    ("nanoserve.engine.outputs", "RequestOutput, incremental detokenizing"),
    ("nanoserve.engine.request", "what the engine holds per request"),
    ("nanoserve.engine.input_processor", "validate and tokenize a request"),
    ("nanoserve.config", "every setting: what each section holds, all of them gathered"),
    ("nanoserve.config.base", "what every config section uses: value checks, one EngineArg"),
    ("nanoserve.config.load", "settings: which model, dtype and device"),
    ("nanoserve.config.cache", "settings: the paged KV pool"),
    ("nanoserve.config.scheduler", "settings: sequences and tokens per step"),
    ("nanoserve.config.args", "ENGINE_ARGS: flat keyword arguments into sections"),
    ("nanoserve.config.engine", "EngineConfig: a validated section per concern"),
    ("nanoserve.extension_points", "where extensions attach: a registry of named points"),
    ("nanoserve.engine.llm_engine", "LLMEngine: add_request / step / abort_request"),
    ("nanoserve.engine.llm", "LLM: the offline façade"),
]
# What the core leans on without being taught in notebooks 00-03: file formats and helpers.
# (The model families read in hf_config.py, and checkpoint formats, are support too; the families
# added since are extensions: one module each under models/families/, found by models/family.py.)
# The extensions' settings live with the others in nanoserve/config/ (as in vLLM), so that one
# EngineConfig describes an engine: data and its checks, imported by the core, read by extensions.
SUPPORT = ["nanoserve.tokenizers", "nanoserve.models.hf_config", "nanoserve.models.hf_fields",
           "nanoserve.models.moe", "nanoserve.models.fused", "nanoserve.models.llama2c",
           "nanoserve.models.hf_export", "nanoserve.models.family", "nanoserve.config.parallel",
           "nanoserve.config.speculative", "nanoserve.config.lora",
           "nanoserve.config.structured_outputs", "nanoserve.config.kv_eviction"]
# The packages and modules that attach to the core (each named by its prefix).
EXTENSIONS = [
    "nanoserve.spec", "nanoserve.lora", "nanoserve.parallel", "nanoserve.quant",
    "nanoserve.serving", "nanoserve.sparsity",
    "nanoserve.tools", "nanoserve.engine.structured_output", "nanoserve.engine.grammar_limits",
    "nanoserve.engine.cuda_graph", "nanoserve.engine.async_step", "nanoserve.engine.late_tokens",
    "nanoserve.engine.cpu_allocator", "nanoserve.engine.kv_eviction",
    "nanoserve.kv.triton_backend",
    "nanoserve.kv.cpu_backend", "nanoserve.kv.quant", "nanoserve.kv.in_place",
    "nanoserve.extensions",
    "nanoserve.models.onednn", "nanoserve.models.triton_layers", "nanoserve.models.gguf_file",
    "nanoserve.models.families", "nanoserve.models.mla", "nanoserve.models.moe_shared",
    "nanoserve.kernels",
]


def module_path(module: str, root: Path = ROOT) -> Path | None:
    """The file of a nanoserve module (a package: its __init__.py), or None."""
    rel = Path(*module.split("."))
    for candidate in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def is_extension(module: str) -> bool:
    return any(module == ext or module.startswith(ext + ".") for ext in EXTENSIONS)


def imports_of(module: str, source: str) -> set[str]:
    """The nanoserve modules `source` (the text of `module`) imports, at any depth of its code."""
    package = module.split(".")
    if not source_is_package(module):
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.update(from_import_targets(node, package))
    return {name for name in found if name.split(".")[0] == "nanoserve"}


def source_is_package(module: str) -> bool:
    path = module_path(module)
    return path is not None and path.name == "__init__.py"


def from_import_targets(node: ast.ImportFrom, package: list[str]) -> list[str]:
    """`from .x import a, b`: the module .x, and .x.a / .x.b where those are modules themselves."""
    if node.level:
        base = package[: len(package) - node.level + 1]
    else:
        base = []
    target = ".".join(base + ([node.module] if node.module else []))
    targets = [target]
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        if module_path(sub) is not None:
            targets.append(sub)
    return targets


def import_graph(start: list[str], read=None) -> dict[str, set[str]]:
    """Every nanoserve module reachable from `start` by imports, with the ones it imports. The top
    package's __init__ (the public façade, which gathers everything) is not followed."""
    read = read or (lambda m: module_path(m).read_text())
    graph: dict[str, set[str]] = {}
    todo = list(start)
    while todo:
        module = todo.pop()
        if module in graph or module == "nanoserve":
            continue
        if module_path(module) is None:
            graph[module] = set()  # a name imported from a package, not a module of its own
            continue
        graph[module] = imports_of(module, read(module)) | parent_packages(module)
        todo.extend(graph[module])
    return graph


def parent_packages(module: str) -> set[str]:
    """The packages Python imports before `module` (but the top one, the public façade)."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts))}


def core_to_extension_edges(read=None) -> set[tuple[str, str]]:
    """(core-side module, extension module) for each import that leads out of the core: following
    the core's imports through every non-extension module they reach."""
    graph = import_graph([m for m, _ in CORE], read)
    return {(src, dst) for src, dsts in graph.items() if not is_extension(src)
            for dst in dsts if is_extension(dst)}


def code_lines(path: Path) -> int:
    """Lines that are neither blank nor only a comment."""
    lines = path.read_text().splitlines()
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def report() -> str:
    rows = []
    core_total = 0
    for module, what in CORE:
        path = module_path(module)
        n = code_lines(path)
        core_total += n
        rows.append(f"  {path.relative_to(ROOT).as_posix():38} {n:5}  {what}")
    total = sum(code_lines(p) for p in package_files())
    edges = core_to_extension_edges()
    rows += [f"  {'core':38} {core_total:5}  lines of code in {len(CORE)} files",
             f"  {'package':38} {total:5}  lines of code in {len(package_files())} files",
             f"  core share {core_total / total:.0%}; extensions and support "
             f"{1 - core_total / total:.0%}",
             f"  imports from the core into an extension: {len(edges)} (--edges lists them)"]
    return "The core, in reading order (scripts/core_size.py):\n" + "\n".join(rows)


BEGIN, END = "<!-- core reading order: begin -->", "<!-- core reading order: end -->"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"


def reading_order_block() -> str:
    """The core's files as a Markdown table, in reading order, between two markers: what
    docs/ARCHITECTURE.md holds (tests/test_layering.py checks it is current)."""
    rows = ["| # | file | lines of code | what it holds |", "|---|---|---|---|"]
    total = 0
    for i, (module, what) in enumerate(CORE, start=1):
        path = module_path(module)
        n = code_lines(path)
        total += n
        rows.append(f"| {i} | `{path.relative_to(ROOT).as_posix()}` | {n} | {what} |")
    rows.append(f"| | the core | {total} | |")
    return "\n".join([BEGIN, *rows, END])


def write_docs() -> None:
    """Replace the block between the markers in docs/ARCHITECTURE.md with the current one."""
    text = ARCHITECTURE.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    ARCHITECTURE.write_text(text[:start] + reading_order_block() + text[end:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", action="store_true", help="list the core's imports of extensions")
    ap.add_argument("--write-docs", action="store_true",
                    help="refresh the reading-order table in docs/ARCHITECTURE.md")
    args = ap.parse_args(argv)
    if args.write_docs:
        write_docs()
        return 0
    if args.edges:
        for src, dst in sorted(core_to_extension_edges()):
            print(f"{src} -> {dst}")
        return 0
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
