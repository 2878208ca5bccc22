"""ENGINE_ARGS: every flat keyword argument an engine takes, the section and field it sets, and its
help for the command line. `LLM(model, **kwargs)`, `LLMEngine.from_kwargs` and the `nanoserve`
command all read this one table; each section's file holds its own rows."""

from __future__ import annotations

import difflib

from .base import EngineArg
from .cache import CACHE_ARGS
from .load import LOAD_ARGS
from .lora import LORA_ARGS
from .parallel import PARALLEL_ARGS
from .scheduler import SCHEDULER_ARGS
from .speculative import SPECULATIVE_ARGS
from .structured_outputs import STRUCTURED_OUTPUTS_ARGS

ENGINE_ARGS: dict[str, EngineArg] = {**LOAD_ARGS, **CACHE_ARGS, **SCHEDULER_ARGS, **PARALLEL_ARGS,
                                     **SPECULATIVE_ARGS, **LORA_ARGS, **STRUCTURED_OUTPUTS_ARGS}


def unknown_argument_message(name: str) -> str:
    """`name` is no engine argument: say so, with the closest valid names."""
    close = difflib.get_close_matches(name, ["model", *ENGINE_ARGS], n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return (f"unknown engine argument {name!r}{hint} (all of them: ENGINE_ARGS in "
            "nanoserve/config/args.py)")
