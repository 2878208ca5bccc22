"""A request as the engine holds it: its parameters, its output, and one `Sample` per parallel
sample (SamplingParams.n), each with its sequence, random stream and incremental text.

`LLMEngine.new_request` builds them (validating the prompt); the engine, the async engine and
the batchers pass them around. Taught in notebooks/03_*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .outputs import CompletionOutput, IncrementalText, RequestOutput
from .sampler import SamplingParams
from .sequence import Sequence as SequenceState

Prompt = str | Sequence[int]


@dataclass(eq=False)
class Sample:
    """Decoding state of one sample: its sequence (token ids, blocks), random stream and text."""

    seq: SequenceState
    generator: torch.Generator | None
    text: IncrementalText
    out: CompletionOutput
    seen: torch.Tensor | None  # prompt + generated ids, for the repetition penalty


@dataclass(eq=False)
class Request:
    params: SamplingParams
    output: RequestOutput
    max_new: int  # max_tokens, capped by the context
    stop_ids: set[int]
    samples: list[Sample] = field(default_factory=list)
