"""The structured-outputs section: what one grammar may ask for, and how its compile and masks run
(engine/grammar_limits.py, engine/structured_output.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..errors import NanoserveError
from .base import EngineArg, arg

LEXER_STATE_BYTES = 2048  # the upper end of llguidance's "approx. 1-2 kB per state"


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
            max_items_in_row=self.max_items_in_row, initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel, step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states, max_grammar_size=self.max_grammar_size,
            verbose_errors=False,
        )


# its keyword arguments (config/args.py)
STRUCTURED_OUTPUTS_ARGS: dict[str, EngineArg] = {
    "grammar_limits": arg("structured_outputs", "whole", "a GrammarLimits", cli=False),
    "grammar_max_bytes": arg("structured_outputs", "max_bytes",
                             "a structured-output constraint's size in bytes"),
    "grammar_compile_timeout": arg("structured_outputs", "compile_timeout_s",
                                   "seconds a constraint may take to compile"),
    "grammar_mask_budget_ms": arg("structured_outputs", "mask_budget_ms",
                                  "CPU ms one row's grammar mask may take; over it, the request "
                                  "fails"),
}


def structured_outputs_section(values: dict) -> GrammarLimits:
    """grammar_limits=GrammarLimits(...) as a whole, or single limits from the command line."""
    whole = values.pop("whole", None)
    base = GrammarLimits() if whole is None else whole
    if not isinstance(base, GrammarLimits):
        raise NanoserveError(f"grammar_limits must be a GrammarLimits, got {type(base).__name__}")
    return replace(base, **values)


