"""Every setting of an engine: one small validated dataclass per concern, in vLLM's names.

    EngineConfig
        load                LoadConfig: which model, dtype and device, 8-bit linears, eager/graphs
        cache               CacheConfig: the paged KV pool (block size, size, K/V dtype, backend)
        scheduler           SchedulerConfig: sequences and tokens per step, the waiting queue
        parallel            ParallelConfig: tensor- or pipeline-parallel ranks
        speculative         SpeculativeConfig, or None: no speculative decoding
        lora                LoRAConfig, or None: no per-request adapters
        structured_outputs  GrammarLimits: what a grammar may ask for (engine/grammar_limits.py)

Each dataclass checks its own fields when it is made, so a bad value is refused by name before any
model loads; `EngineConfig` checks the few rules that span two of them. Users rarely build these by
hand: `LLM(model, **kwargs)`, `LLMEngine.from_kwargs` and the `nanoserve` command take flat keyword
arguments (`max_num_seqs=8`, `--max-num-seqs 8`) and `EngineConfig.from_kwargs` sorts them into the
sections with the table ENGINE_ARGS. An unknown name is an error that suggests the closest ones.

This module imports nothing from the rest of nanoserve but its errors, so that the core and every
extension can read their settings from here (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, replace

from .errors import ConfigError, NanoserveError

# quant/online.py: 8-bit linears made as they load
QUANTIZATION_METHODS = ("fp8", "int8", "llm.int8")
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")  # kv/quant.py
ATTENTION_BACKENDS = ("torch", "triton", "cpu")  # kv/: gather + SDPA, nanoserve.kernels, C decode
# spec/proposers.py, medusa.py, eagle.py
SPECULATIVE_METHODS = ("draft", "ngram", "medusa", "eagle")
# γ beyond this almost never pays: α^γ is tiny (it bounds test sizes too)
MAX_SPECULATIVE_TOKENS = 16
# Medusa's speculative_tree="default": 8 candidates to depth 3 (3 heads): the first head's top 2;
# after its best, the second head's top 2, after its second best, the second head's best; after the
# best pair, the third head's top 2; after (0, 1), its best
DEFAULT_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)]
LEXER_STATE_BYTES = 2048  # the upper end of llguidance's "approx. 1-2 kB per state"


def check_int(name: str, value, minimum: int = 1, optional: bool = False) -> None:
    """Raise NanoserveError unless `value` is an int ≥ `minimum` (or None, when `optional`)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an integer ≥ {minimum}" + (" or None" if optional else "")
        raise NanoserveError(f"{name}={value!r} must be {allowed}")


def check_choice(name: str, value, allowed: tuple, optional: bool = False) -> None:
    """Raise NanoserveError unless `value` is one of `allowed` (or None, when `optional`)."""
    if optional and value is None:
        return
    if value not in allowed:
        none = "None (the default), " if optional else ""
        raise NanoserveError(f"{name}={value!r}; allowed: {none}{', '.join(allowed)}")


def check_block_size(block_size: int) -> None:
    """Raise NanoserveError unless `block_size` is a power of two (an int ≥ 1)."""
    if type(block_size) is not int or block_size <= 0 or block_size & (block_size - 1):
        raise NanoserveError(f"block_size={block_size!r} is not allowed; "
                             "it must be a power of two: 1, 2, 4, ... 16")


@dataclass(frozen=True)
class LoadConfig:
    """Which model, in what precision, on which device, and how its forward runs."""

    # a shipped name (demo), a checkpoint directory, a llama2.c .bin or a hub id
    model: str = "demo"
    dtype: object = None  # "float32", "bfloat16", a torch.dtype; None: the device's default
    device: str | None = None  # "cpu", "cuda", "cuda:N"; None: cuda when available
    quantization: str | None = None  # make a float checkpoint's linears 8-bit as they load
    enforce_eager: bool = False  # no CUDA graphs for decode steps

    def __post_init__(self):
        check_choice("quantization", self.quantization, QUANTIZATION_METHODS, optional=True)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` blocks of `block_size` tokens, and who reads it."""

    block_size: int = 16  # tokens per block, a power of two
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes for the pool; None: 8 full-context sequences
    num_blocks: int | None = None  # the pool's size in blocks, overriding kv_cache_memory
    # auto: the model's dtype; else 8 bits with a scale per token and head
    kv_cache_dtype: str = "auto"
    attention_backend: str | None = None  # None: triton on CUDA, cpu on the CPU, where they serve

    def __post_init__(self):
        check_block_size(self.block_size)
        check_int("kv_cache_memory", self.kv_cache_memory, optional=True)
        check_int("num_blocks", self.num_blocks, optional=True)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS, optional=True)


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits per step, and the waiting queue's bound."""

    max_num_seqs: int = 64  # sequences in one forward
    max_num_batched_tokens: int = 512  # new tokens in one forward (the token budget)
    enable_chunked_prefill: bool = True
    max_waiting: int | None = None  # None = unbounded

    def __post_init__(self):
        check_int("max_num_seqs", self.max_num_seqs)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_int("max_waiting", self.max_waiting, optional=True)

    def validate(self, max_model_len: int) -> None:
        """The rule that needs the model: without chunked prefill, a whole prompt fits one step."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise NanoserveError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be ≥ the context "
                f"length {max_model_len} when chunked prefill is off (a whole prompt must fit in "
                "one step)")


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks the model is split over (nanoserve/parallel/): one kind of split at a time."""

    tensor_parallel_size: int = 1  # every layer split N ways
    pipeline_parallel_size: int = 1  # the stack of blocks split into N stages

    def __post_init__(self):
        check_int("tensor_parallel_size", self.tensor_parallel_size)
        check_int("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise NanoserveError(
                f"tensor_parallel_size={self.tensor_parallel_size} with pipeline_parallel_size="
                f"{self.pipeline_parallel_size}: one kind of split at a time (not both yet)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def kind(self) -> str:
        """"tensor" or "pipeline" (what the ranks split), "none" for one rank."""
        if self.tensor_parallel_size > 1:
            return "tensor"
        if self.pipeline_parallel_size > 1:
            return "pipeline"
        return "none"

    @property
    def size_name(self) -> str:
        """The argument that set the world size, for messages: "tensor_parallel_size=2"."""
        name = "pipeline_parallel_size" if self.kind == "pipeline" else "tensor_parallel_size"
        return f"{name}={self.world_size}"


def _as_path(choice):
    """A path given as a list reads as the tuple it stands for; anything else is checked as is."""
    if isinstance(choice, list):
        return tuple(choice)
    return choice


def check_tree_choices(choices) -> list[tuple[int, ...]] | None:
    """Medusa's tree as paths of top-k indices, checked and sorted (shorter first): each non-empty,
    of indices ≥ 0, listed once, its parent path listed too, at most MAX_SPECULATIVE_TOKENS in all.
    None stays None (no tree: a chain)."""
    if choices is None:
        return None
    if isinstance(choices, (str, bytes)) or not hasattr(choices, "__iter__"):
        raise NanoserveError("speculative_tree must be a list of paths such as "
                             f"[(0,), (1,), (0, 0)] or 'default', got {choices!r}")
    paths = [_as_path(c) for c in choices]
    for c in paths:
        if not isinstance(c, tuple) or not c or not all(_is_index(i) for i in c):
            raise NanoserveError(f"speculative_tree: each path must be a non-empty tuple of top-k "
                                 f"indices ≥ 0, got {c!r}")
        if len(c) > 1 and c[:-1] not in paths:
            raise NanoserveError(f"speculative_tree: path {c} is listed without its parent path "
                                 f"{c[:-1]}")
    if len(set(paths)) != len(paths):
        raise NanoserveError("speculative_tree lists a path twice")
    if not 1 <= len(paths) <= MAX_SPECULATIVE_TOKENS:
        raise NanoserveError(f"speculative_tree has {len(paths)} paths; allowed: "
                             f"1..{MAX_SPECULATIVE_TOKENS} (each is a token the target verifies)")
    return sorted(paths, key=lambda c: (len(c), c))


def _is_index(i) -> bool:
    return isinstance(i, int) and not isinstance(i, bool) and i >= 0


@dataclass
class SpeculativeConfig:
    """What speculative decoding runs with (nanoserve/spec/). `tree` (Medusa only): the heads' top-1
    chain becomes a token tree of top-k paths, as Medusa's "choices" (spec/tree_sampler.py)."""

    method: str  # "draft" (a small model), "ngram" (prompt lookup), "medusa" or "eagle" (heads)
    num_speculative_tokens: int = 4  # γ: the most tokens drafted per step
    draft_model: str | None = None  # draft: a model; medusa, eagle: the heads' directory
    adaptive: bool = True  # pick each sample's γ from its observed acceptance (else always γ)
    min_acceptance: float = 0.3  # below this estimated α a sample stops speculating (then probes)
    probe_interval: int = 16  # plain steps between probes of a switched-off sample
    ngram_max: int = 3  # n-gram lookup: longest and shortest suffix to match
    ngram_min: int = 1
    # c pinned (v = 1, nothing timed); None: measured (spec/controller.py)
    cost: float | None = None
    tree: list[tuple[int, ...]] | None = None  # Medusa: top-k paths; None: a chain

    def __post_init__(self):
        if self.tree == "default":
            self.tree = DEFAULT_TREE
        self.tree = check_tree_choices(self.tree)
        self.validate()

    def validate(self) -> None:
        check_choice("speculative", self.method, SPECULATIVE_METHODS)
        g = self.num_speculative_tokens
        if not isinstance(g, int) or isinstance(g, bool) or not 1 <= g <= MAX_SPECULATIVE_TOKENS:
            raise NanoserveError(f"num_speculative_tokens={g!r} must be an integer in "
                                 f"1..{MAX_SPECULATIVE_TOKENS}")
        if self.method == "draft" and not self.draft_model:
            raise NanoserveError("speculative decoding with a draft model needs "
                                 "speculative_model=<name or path>")
        if self.method in ("medusa", "eagle") and not self.draft_model:
            what = {"medusa": "the Medusa heads' directory", "eagle": "the EAGLE head's directory"}
            raise NanoserveError(f"speculative={self.method!r} needs "
                                 f"speculative_model=<{what[self.method]}>")
        if not 0 <= self.min_acceptance < 1:
            raise NanoserveError(f"min_acceptance={self.min_acceptance!r} must be in [0, 1)")
        if self.tree is not None and self.method != "medusa":
            raise NanoserveError("speculative_tree is for speculative='medusa' (its heads' top-k "
                                 f"candidates), not {self.method!r}, whose proposer drafts one "
                                 "chain")
        c = self.cost
        finite = isinstance(c, (int, float)) and not isinstance(c, bool) and 0 <= c < float("inf")
        if c is not None and not finite:
            raise NanoserveError(f"speculative_cost={c!r} must be a finite number ≥ 0 (a draft "
                                 "forward's cost in target steps), or None to measure it")


@dataclass(frozen=True)
class LoRAConfig:
    """Per-request LoRA adapters (lora/serving.py): slots in one step, and the largest rank."""

    max_loras: int = 4  # distinct adapters among the running sequences
    max_lora_rank: int = 16

    def __post_init__(self):
        check_int("max_loras", self.max_loras)
        check_int("max_lora_rank", self.max_lora_rank)


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """What one structured-output constraint may ask for, and how its work runs
    (engine/grammar_limits.py)."""

    # what a request may send (checked before compiling)
    max_bytes: int = 65_536  # a schema as JSON, a regex, a Lark grammar, or the choices together
    max_nesting: int = 64  # a schema's objects and arrays, a regex's groups, a grammar's brackets
    max_rules: int = 1_000  # Lark rules and terminals (a chain of ~2,800 overflowed an 8 MB stack)
    max_choices: int = 1_000  # strings in one `choice`
    max_regex_size: int = 10_000  # a regex with every {n,m} written out: (a{1000}){999} is 999,000
    # how the work runs
    compile_timeout_s: float = 10.0  # compile + first mask; a request waits no longer
    compile_threads: int = 2  # the compile pool: a slow compile holds one of these, never the step
    max_queued_compiles: int = 64  # compiles queued or running at once; past it: a 429
    mask_budget_ms: float = 250.0  # one row's mask in one step; over it, that request fails alone
    cache_bytes: int = 2 << 30  # compiled grammars kept, each counted at its lexer's largest size
    # llguidance's LLParserLimits (its defaults but for max_lexer_states, ~1-2 kB a state)
    max_items_in_row: int = 2_000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_lexer_states: int = 50_000
    max_grammar_size: int = 500_000

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            if f.type == "int":
                ok = ok and isinstance(value, int)
            if not ok:
                raise NanoserveError(
                    f"GrammarLimits.{f.name}={value!r} must be a positive {f.type}"
                )

    def grammar_bytes_bound(self) -> int:
        """The most one compiled grammar can hold: its lexer's states at their largest (llguidance's
        documentation: 1-2 kB a state; copies share them). What the cache counts each entry as."""
        return self.max_lexer_states * LEXER_STATE_BYTES

    def cache_entries(self) -> int:
        """How many compiled grammars the cache keeps: cache_bytes at the bound above (≥ 1)."""
        return max(1, self.cache_bytes // self.grammar_bytes_bound())

    def parser_limits(self):
        """llguidance's LLParserLimits with every field set from these limits."""
        from llguidance import LLParserLimits

        return LLParserLimits(
            max_items_in_row=self.max_items_in_row,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
            verbose_errors=False,
        )


@dataclass
class EngineConfig:
    """One engine's settings, a section per concern (see the module's docstring)."""

    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None
    structured_outputs: GrammarLimits = field(default_factory=GrammarLimits)

    def __post_init__(self):
        for f in fields(self):
            want = SECTION_TYPES[f.name]
            value = getattr(self, f.name)
            optional = f.name in ("speculative", "lora")
            if not isinstance(value, want) and not (optional and value is None):
                raise ConfigError(f"EngineConfig.{f.name} must be a {want.__name__}, "
                                  f"got {type(value).__name__}")
        self._check_parallel()

    def _check_parallel(self) -> None:
        """What the split engine does not run yet, refused by name."""
        if self.parallel.world_size == 1:
            return
        if self.speculative is not None:
            raise NanoserveError("speculative decoding is not supported with "
                                 f"{self.parallel.size_name} yet")
        if self.lora is not None:
            raise NanoserveError(f"enable_lora is not supported with {self.parallel.size_name} yet")

    @property
    def model(self) -> str:
        return self.load.model

    @classmethod
    def from_kwargs(cls, model: str = "demo", **kwargs) -> EngineConfig:
        """The config of flat keyword arguments (`max_num_seqs=8`), each sorted into its section by
        ENGINE_ARGS. An unknown name, or an option of a feature that is off, is an error."""
        unknown = [name for name in kwargs if name not in ENGINE_ARGS]
        if unknown:
            raise ConfigError(unknown_argument_message(unknown[0]))
        sections: dict[str, dict] = {}
        for name, value in kwargs.items():
            arg = ENGINE_ARGS[name]
            sections.setdefault(arg.section, {})[arg.field] = value
        load = LoadConfig(model=model, **sections.get("load", {}))
        return cls(load=load,
                   cache=CacheConfig(**sections.get("cache", {})),
                   scheduler=SchedulerConfig(**sections.get("scheduler", {})),
                   parallel=ParallelConfig(**sections.get("parallel", {})),
                   speculative=_speculative_section(sections.get("speculative", {})),
                   lora=_lora_section(sections.get("lora", {})),
                   structured_outputs=_structured_section(sections.get("structured_outputs", {})))


SECTION_TYPES = {"load": LoadConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                 "parallel": ParallelConfig, "speculative": SpeculativeConfig, "lora": LoRAConfig,
                 "structured_outputs": GrammarLimits}


def _speculative_section(values: dict) -> SpeculativeConfig | None:
    """speculative / speculative_model turn speculation on; its other options need one of them."""
    if values.get("method") is None and values.get("draft_model") is None:
        if values:
            raise NanoserveError(f"{_flat_name('speculative', next(iter(values)))} needs "
                                 "speculative=<method> or speculative_model=<name> "
                                 "(no speculative decoding is on)")
        return None
    values = dict(values)
    if values.get("method") is None:
        values["method"] = "draft"
    return SpeculativeConfig(**values)


def _flat_name(section: str, field_name: str) -> str:
    """The keyword argument that sets `section`.`field_name` (ENGINE_ARGS read backwards)."""
    for name, arg in ENGINE_ARGS.items():
        if (arg.section, arg.field) == (section, field_name):
            return name
    return field_name


def _lora_section(values: dict) -> LoRAConfig | None:
    """enable_lora=True turns adapters on; max_loras and max_lora_rank apply to them."""
    values = dict(values)
    enabled = values.pop("enabled", False)
    if not isinstance(enabled, bool):
        raise NanoserveError(f"enable_lora={enabled!r} must be True or False")
    if not enabled and values:
        raise NanoserveError(f"{_flat_name('lora', next(iter(values)))} needs enable_lora=True")
    if not enabled:
        return None
    return LoRAConfig(**values)


def _structured_section(values: dict) -> GrammarLimits:
    """grammar_limits=GrammarLimits(...) as a whole, or single limits from the command line."""
    whole = values.pop("whole", None)
    base = GrammarLimits() if whole is None else whole
    if not isinstance(base, GrammarLimits):
        raise NanoserveError(f"grammar_limits must be a GrammarLimits, got {type(base).__name__}")
    return replace(base, **values)


@dataclass(frozen=True)
class EngineArg:
    """One flat keyword argument: the section and field it sets, and its help for the command line
    (cli=False: Python only, as a list or an object cannot be typed on a command line)."""

    section: str
    field: str
    help: str
    cli: bool = True
    choices: tuple = ()  # the values allowed, where they are a list of names


def _arg(section: str, name: str, help: str, cli: bool = True, choices: tuple = ()) -> EngineArg:
    return EngineArg(section, name, help, cli, choices)


# keyword argument → (section, field, help). LLM, LLMEngine.from_kwargs and the CLI all read this.
ENGINE_ARGS: dict[str, EngineArg] = {
    "dtype": _arg("load", "dtype", "float32, float16 or bfloat16 (default: float32 on CPU, "
                                   "bfloat16 on CUDA where the GPU has it, else float16)"),
    "device": _arg("load", "device", "cpu, cuda or cuda:N (default: cuda when available)"),
    "quantization": _arg("load", "quantization", "make a float checkpoint's linears 8-bit as it "
                         "loads: W8A8 fp8 or int8, or LLM.int8", choices=QUANTIZATION_METHODS),
    "enforce_eager": _arg("load", "enforce_eager", "no CUDA graphs for decode steps (debugging)"),
    "block_size": _arg("cache", "block_size", "tokens per KV block (a power of two)"),
    "enable_prefix_caching": _arg("cache", "enable_prefix_caching",
                                  "share the KV blocks of common prompt prefixes"),
    "kv_cache_memory": _arg("cache", "kv_cache_memory",
                            "bytes for the KV cache (default: 8 full-context sequences)"),
    "num_blocks": _arg("cache", "num_blocks", "KV cache blocks (overrides --kv-cache-memory)"),
    "kv_cache_dtype": _arg("cache", "kv_cache_dtype", "auto: K/V in the model's dtype; else 8 bits "
                           "with a scale per token and head", choices=KV_CACHE_DTYPES),
    "attention_backend": _arg("cache", "attention_backend", "attention over the KV cache (default: "
                              "triton on CUDA, cpu on the CPU, where they serve)",
                              choices=ATTENTION_BACKENDS),
    "max_num_seqs": _arg("scheduler", "max_num_seqs", "sequences in one forward"),
    "max_num_batched_tokens": _arg("scheduler", "max_num_batched_tokens",
                                   "new tokens in one forward"),
    "enable_chunked_prefill": _arg("scheduler", "enable_chunked_prefill",
                                   "split long prompts over steps, beside the decodes"),
    "max_waiting": _arg("scheduler", "max_waiting",
                        "waiting-queue bound: beyond it requests get 429"),
    "tensor_parallel_size": _arg("parallel", "tensor_parallel_size",
                                 "ranks every layer is split over (workers)"),
    "pipeline_parallel_size": _arg("parallel", "pipeline_parallel_size",
                                   "stages the blocks are split into (workers)"),
    "speculative": _arg("speculative", "method", "the proposer (ngram: prompt lookup)",
                        choices=SPECULATIVE_METHODS),
    "speculative_model": _arg("speculative", "draft_model",
                              "a draft model (e.g. demo-draft), or the Medusa / EAGLE heads' "
                              "directory"),
    "num_speculative_tokens": _arg("speculative", "num_speculative_tokens",
                                   f"γ, draft tokens per step (1..{MAX_SPECULATIVE_TOKENS})"),
    "speculative_adaptive": _arg("speculative", "adaptive",
                                 "pick each sample's γ from its observed acceptance"),
    "speculative_cost": _arg("speculative", "cost", "pin a draft forward's cost in target steps "
                             "(default: measured; pinned, seeded sampling no longer depends on the "
                             "machine's speed)"),
    "speculative_tree": _arg("speculative", "tree", "Medusa's token tree (paths)", cli=False),
    "enable_lora": _arg("lora", "enabled", "serve per-request LoRA adapters"),
    "max_loras": _arg("lora", "max_loras", "LoRA adapters in one step (slots)"),
    "max_lora_rank": _arg("lora", "max_lora_rank", "the largest adapter rank a slot holds"),
    "grammar_limits": _arg("structured_outputs", "whole", "a GrammarLimits", cli=False),
    "grammar_max_bytes": _arg("structured_outputs", "max_bytes",
                              "a structured-output constraint's size in bytes"),
    "grammar_compile_timeout": _arg("structured_outputs", "compile_timeout_s",
                                    "seconds a constraint may take to compile"),
    "grammar_mask_budget_ms": _arg("structured_outputs", "mask_budget_ms",
                                   "CPU ms one row's grammar mask may take; over it, the request "
                                   "fails"),
}


def unknown_argument_message(name: str) -> str:
    """`name` is no engine argument: say so, with the closest valid names."""
    close = difflib.get_close_matches(name, ["model", *ENGINE_ARGS], n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown engine argument {name!r}{hint} (all of them: nanoserve/config.py, ENGINE_ARGS)"
