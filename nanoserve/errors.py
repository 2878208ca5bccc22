"""nanoserve's error types, and the line between a request's failure and the engine's.

Every error a user can cause with bad input is a `NanoserveError` whose message names the
bad value and what is allowed. The CLI prints such errors as one line and exits 2; a server
answers 400. Anything else is a bug and keeps its traceback.

While serving, a fault can hit one request or everyone (LLMEngine.step draws the line):
- `RequestFailedError`: one request failed inside the engine (a fault while sampling or
  detokenizing its row, non-finite logits). That request ends with the error, its blocks go
  back to the pool, and every other request goes on. A server answers 500 for it alone.
- `EngineStateError`: state that every request shares (the block pool, the scheduler's queues,
  the device) is broken. Nothing computed afterwards could be trusted, so the engine stops.
`is_fatal` tells which of the two an unexpected exception is.
"""

import torch


class NanoserveError(ValueError):
    """Bad input: a path, a config, a prompt or a parameter that nanoserve cannot accept."""


class CheckpointError(NanoserveError):
    """A model path or checkpoint file that cannot be loaded."""


class ConfigError(NanoserveError):
    """A model config that is missing a field or names something unsupported."""


class GrammarError(NanoserveError):
    """A constraint the server will not run: too large, too deep, too slow, or with no valid output.
    A client's mistake (HTTP 400), also when it shows only at a later token (structured outputs)."""


def first_line(text: str | None) -> str:
    """The first non-empty line of an error text (a grammar engine's: its state dump follows)."""
    text = (text or "").strip()
    return text.splitlines()[0] if text else "no reason given"


class RequestFailedError(RuntimeError):
    """One request failed inside the engine; it alone ends (HTTP 500), the others go on."""


class EngineStateError(RuntimeError):
    """Shared engine state is inconsistent (a block freed twice, a sequence that can never be
    scheduled): the engine must stop rather than compute on top of it."""


def is_fatal(error: BaseException) -> bool:
    """True when `error` may have broken state every request shares, so the engine must stop.

    Bookkeeping invariants (EngineStateError, a failed assert) and device faults are fatal: after
    a CUDA error the context is unusable for everyone. Everything else raised while serving one
    request's row (a bug in sampling, detokenizing, a stop check) is that request's alone.
    """
    if isinstance(error, (EngineStateError, AssertionError, MemoryError)):
        return True
    # torch >= 2.8 raises it for CUDA faults
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and "CUDA error" in str(error)


def check(ok: bool, message: str) -> None:
    """Raise NanoserveError(message) unless ok: argument checks that read as one line each."""
    if not ok:
        raise NanoserveError(message)


def is_int(x) -> bool:
    """An int and not a bool (True is an int in Python, never a valid count here)."""
    return isinstance(x, int) and not isinstance(x, bool)
