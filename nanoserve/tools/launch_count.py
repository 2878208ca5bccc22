"""Count the kernels one decode step launches, on any machine.

A decode step on a GPU is bound by how many kernels it launches as much as by the bytes it reads:
each launch costs a few microseconds of the GPU's time even inside a CUDA graph, and a Llama layer
that launches forty small kernels spends more time between them than in them. What a step
launches does not depend on the device, so it can be counted on a CPU:

- every aten operator that is not a view (a view — `view`, `transpose`, `slice`, ... — only
  reinterprets memory and launches nothing) nor an allocation (`empty`, ...), seen through a
  TorchDispatchMode;
- every dtype or device conversion that copies (`.to`, `.float()`, ...), seen at the Python level
  (torch does not show them to a dispatch mode on inference tensors, which the forward reads);
- every Triton kernel launch (`JITFunction.run`, or `InterpretedFunction.run` in the interpreter),
  the aten operators inside the interpreter's emulation not counted;

inside `ModelRunner.execute` only — the forward a CUDA graph captures — not the host work that
prepares its inputs. The kernels' value checks read device values, which a GPU skips (they would
sync), so they are off while counting (kernels/checks.py: `values_unread`).

    with LaunchCounter() as counter:     # any code: counter.aten, counter.triton (Counters)
        ...
    count_decode_step(llm)               # one steady decode step of an LLM: a LaunchCounter
    per_layer(path, backend)             # (per layer, per step): two random Llamas of 1 and 3
                                         # layers, the difference halved (benchmarks/bench_launches)
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack, contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# allocations: memory from the caching allocator, no kernel (a GPU launches nothing for them)
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


# dtype and device conversions: seen at the Python level, because the dispatch mode does not see
# them on inference tensors (torch skips it for `.to` there); one copy each when they copy
CONVERSIONS = {torch.Tensor.to, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16,
               torch.Tensor.int, torch.Tensor.long, torch.Tensor.double, torch.Tensor.type,
               torch.Tensor.cpu, torch.Tensor.cuda}


def is_view(func) -> bool:
    """Whether an aten overload returns views of its inputs only (launches no kernel)."""
    returns = func._schema.returns
    if not returns:
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class LaunchCounter(TorchDispatchMode):
    """Counts the aten operators that launch a kernel (by name) and the Triton launches (by kernel)
    run inside it."""

    def __init__(self):
        super().__init__()
        self.aten: Counter[str] = Counter()
        self.triton: Counter[str] = Counter()
        self._quiet = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._quiet and not is_view(func) and name not in ALLOCATIONS:
            self.aten[name] += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return sum(self.aten.values()) + sum(self.triton.values())

    def __enter__(self):
        self._stack = ExitStack()
        self._stack.enter_context(_triton_launches_counted(self))
        self._stack.enter_context(_value_checks_off())
        self._stack.enter_context(_ConversionsCounted(self))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stack.close()


class _ConversionsCounted(TorchFunctionMode):
    """Counts a dtype or device conversion that copies as one `_to_copy`, whatever the tensor (the
    dispatch mode is kept quiet meanwhile, so it is never counted twice)."""

    def __init__(self, counter: LaunchCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in CONVERSIONS:
            return func(*args, **(kwargs or {}))
        self.counter._quiet += 1
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.counter._quiet -= 1
        if isinstance(out, torch.Tensor) and out is not args[0] and not self.counter._quiet:
            self.counter.aten["_to_copy"] += 1
        return out


@contextmanager
def _triton_launches_counted(counter: LaunchCounter):
    """Triton's launchers wrapped: each launch counted, nothing inside it (the interpreter's own
    tensor operations)."""
    classes = []
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        classes = [JITFunction, InterpretedFunction]
    except ImportError:  # no Triton: nothing to count
        pass
    originals = {cls: cls.run for cls in classes}

    def counted(original):
        def run(self, *args, grid, warmup, **kwargs):
            if not warmup:
                counter.triton[self.fn.__name__] += 1
            counter._quiet += 1
            try:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                counter._quiet -= 1
        return run

    for cls, original in originals.items():
        cls.run = counted(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original


@contextmanager
def _value_checks_off():
    """The kernels' value checks skipped, as on a GPU (nothing to do without the kernels)."""
    try:
        from ..kernels.checks import values_unread
    except ImportError:
        yield
        return
    with values_unread():
        yield


def count_decode_step(llm, prompt: list[int] | None = None) -> LaunchCounter:
    """The launches of one steady decode step of `llm`'s engine: one request, prefilled and one
    token decoded first (so nothing is built for the first time), then one step counted inside the
    model runner's `execute`."""
    from ..engine.sampling_params import SamplingParams

    engine = llm.engine
    if engine.has_unfinished_requests():
        raise RuntimeError("count_decode_step needs an idle engine")
    prompt = prompt or list(range(10, 30))
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prefill (and the first token)
    engine.step()  # one decode step, uncounted
    counter = LaunchCounter()
    runner = engine.runner
    # the forward without its inference_mode (under it, torch skips the dispatch mode for a dtype
    # conversion: `.to(torch.int32)` would go uncounted); no_grad records no graph either
    forward = type(runner).execute.__wrapped__

    def counted(inputs):
        with counter, torch.no_grad():
            return forward(runner, inputs)

    runner.execute = counted
    try:
        engine.step()
    finally:
        del runner.execute  # the method again
    while engine.has_unfinished_requests():
        engine.step()
    return counter


def llama_shape(n_layers: int):
    """A small Llama with the 1B class's structure (head_dim 64, 4 query heads per KV head, SwiGLU,
    tied embeddings): what a step launches depends on the structure, not the widths."""
    from ..models.config import ModelConfig

    return ModelConfig(arch="llama", vocab_size=320, hidden_size=256, n_layers=n_layers, n_heads=4,
                       n_kv_heads=1, intermediate_size=512, max_position_embeddings=256,
                       tie_word_embeddings=True, rope_theta=500000.0, eos_token_ids=[256])


def random_checkpoint(path, cfg, seed: int = 0):
    """A checkpoint directory of `cfg` with random weights and the byte tokenizer."""
    from pathlib import Path

    from ..models import build_model
    from ..models.loader import save_checkpoint
    from ..tokenizers.bpe import byte_level_tokenizer
    from ..tokenizers.tiktoken_file import save_tiktoken

    path = Path(path)
    torch.manual_seed(seed)
    model = build_model(cfg)
    save_checkpoint(model, path)
    save_tiktoken(byte_level_tokenizer(), path)
    return path


def per_layer(workdir, backend: str, **llm_kwargs) -> tuple[Counter, Counter]:
    """(launches per layer, launches per step outside the layers) of a steady decode step on
    `backend`, by kernel name: random Llamas of 1 and 3 layers (llama_shape), the difference
    halved."""
    from pathlib import Path

    from ..engine.llm import LLM

    counts = {}
    for n_layers in (1, 3):
        path = Path(workdir) / f"llama-{n_layers}"
        if not path.exists():
            random_checkpoint(path, llama_shape(n_layers))
        llm = LLM(str(path), dtype="float32", device="cpu", attention_backend=backend,
                  **llm_kwargs)
        counter = count_decode_step(llm)
        counts[n_layers] = counter.aten + Counter(counter.triton)
    layer = Counter()
    for name in counts[3]:
        extra = counts[3][name] - counts[1][name]
        if extra % 2:
            raise RuntimeError(f"{name}: {extra} more launches for 2 more layers: not per layer")
        if extra:
            layer[name] = extra // 2
    fixed = counts[1] - layer
    return layer, fixed
