"""No device→host read in the step's hot path but the sampled tokens (issue 18).

On a GPU, every `.item()`, `.tolist()`, `bool(tensor)`, `int(tensor)`, `nonzero()` or boolean-mask
index stalls the host until the device catches up, and none of them can be captured in a CUDA graph.
This machine has no GPU, so the test watches for the calls themselves: a TorchFunctionMode records
every such call made while the forward (`ModelRunner.execute`) and the sampling (`request.draw`:
grammar masks, `sample_batch`, logprobs) run, with the module that made it, for a prefill step and a
decode step, on both attention backends. Exactly one is allowed: the sampler's transfer of the
step's tokens. Calls made inside Triton's interpreter or the kernels' own input checks are not the
engine's (on a GPU the kernels read no values unless debug checks are on; tests/test_kernels_*.py
check that); the host-side `ModelRunner.prepare` works on CPU tensors by design and is not watched.
A negative control brings back the old view, which found the real tokens with `nonzero()` on the
device.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nanoserve import SamplingParams
from nanoserve.engine import llm_engine
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.kv.torch_backend import CacheView

SYNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere", "numpy",
         "cpu", "masked_select", "unique", "unique_consecutive", "nanmedian", "equal"}
NOT_OURS = ("triton", "nanoserve.kernels")


class SyncSpy(TorchFunctionMode):
    """Records (function, calling module) for each call that reads device values back to the
    host."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        caller = sys._getframe(1).f_globals.get("__name__", "?")
        boolean_index = (
            name in ("__getitem__", "__setitem__")
            and len(args) > 1
            and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for i in (args[1] if isinstance(args[1], tuple) else (args[1],))
            )
        )
        if (name in SYNCS or boolean_index) and not caller.startswith(NOT_OURS):
            self.calls.append((name, caller))
        return func(*args, **(kwargs or {}))

    def unwatched(self, fn):
        """fn with its reads left out of the record: host-side work that reads CPU tensors by
        design (building a step's inputs)."""
        def run(*args, **kwargs):
            before = len(self.calls)
            out = fn(*args, **kwargs)
            del self.calls[before:]
            return out
        return run


def _watched_step(engine: LLMEngine, monkeypatch) -> list[tuple[str, str]]:
    """One engine step with the forward and the sampler watched; returns the reads they made."""
    spy = SyncSpy()
    # draw: grammar masks, sampler, logprobs
    execute, sample = engine.runner.execute, llm_engine.draw

    def watched(fn):
        def run(*args, **kwargs):
            with spy:
                return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(engine.runner, "execute", watched(execute))
    monkeypatch.setattr(llm_engine, "draw", watched(sample))
    engine.step()
    monkeypatch.undo()
    return spy.calls


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_and_decode_steps_read_back_only_the_sampled_tokens(backend, monkeypatch):
    engine = LLMEngine.from_kwargs("demo", attention_backend=backend, block_size=8)
    for prompt, seed in (("ROMEO:", 1), ("JULIET: O Romeo", None)):
        engine.add_request(prompt,
                           SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=seed,
                                          max_tokens=4))
    engine.add_request("KING:", SamplingParams(temperature=0, repetition_penalty=1.2, max_tokens=4))
    prefill = _watched_step(engine, monkeypatch)
    decode = _watched_step(engine, monkeypatch)
    assert prefill == [("tolist", "nanoserve.engine.sampler")], prefill
    assert decode == [("tolist", "nanoserve.engine.sampler")], decode


class _OldView(CacheView):
    """The view before issue 18: the real tokens found on the device, every step."""

    def __init__(self, cache, meta):
        super().__init__(cache, meta)
        self.src = (meta.slot_mapping.flatten() >= 0).nonzero().squeeze(1)


def test_sync_negative_control_the_old_view_is_caught(monkeypatch):
    engine = LLMEngine.from_kwargs("demo", attention_backend="torch")
    engine.add_request("ROMEO:", SamplingParams(temperature=0, max_tokens=3))
    monkeypatch.setattr(engine.runner.kv, "bind", lambda meta: _OldView(engine.runner.kv, meta))
    calls = _watched_step(engine, monkeypatch)
    assert ("nonzero", __name__) in calls and len(calls) == 2, calls


def test_the_spy_sees_each_kind_of_read():
    x = torch.arange(6)
    with SyncSpy() as spy:
        x.sum().item(), x.tolist(), bool(x.any()), int(x.max()), x[x > 2], (x > 1).nonzero(), x.cpu()
    assert [name for name, _ in spy.calls] == ["item", "tolist", "__bool__", "__int__",
                                               "__getitem__", "nonzero",
                                               "cpu"]
