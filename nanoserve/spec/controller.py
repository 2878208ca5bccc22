"""The adaptive speculative controller: each sample's γ, from its acceptance rate and measured
costs.

`SpecController` keeps, per sample, an estimate of α and the γ that maximises the expected speedup
E(α, γ) / cost(γ); `StepCosts` is its clock: what speculating costs, measured on the engine's own
steps.

A speculative step of γ drafts costs γ draft forwards and one verification (the target scoring γ + 1
tokens), against one plain decode step that emits one token. In units of a plain step:

    cost(γ) = v + c·γ        c = draft forward / plain step,  v = verification / plain step

(a proposer that drafts all γ tokens in one call, n-gram lookup or Medusa's heads, costs v + c: its
`one_call` is True and c is that call),

and the expected speedup of a sample is E(γ) / cost(γ), E the expected tokens per verification. E is
not taken from one acceptance rate α (rejection_sampler.expected_tokens_per_step: every draft kept
with the same chance, independently): measured, the later drafts of Medusa's heads are kept far more
often once the earlier ones were (the text is predictable there), and one α put E(3) at 1.42 tokens
where the heads made 1.60. So the controller keeps one rate per draft position, α_i = P(draft i kept
| drafts 1..i−1 kept) — a tree's depth i, for a token tree — and E(γ) = 1 + Σ_{i ≤ γ} α_1·…·α_i
(`expected_tokens`).
Neither cost ratio is known ahead:

- c is not the draft/target parameter ratio. On a CPU a tiny draft's forward is dominated by fixed
  per-layer overheads (measured 0.5–0.7 of the demo target's step for a draft 11× smaller); on a GPU
  a draft's step costs its launches, and the 28M-parameter draft of a 1B target cost 3.4 target
  steps when the target ran CUDA graphs and the draft did not (benchmarks/RESULTS.md, the GPU pass).
- v is not 1. Verifying γ + 1 tokens costs more than decoding 1 on a CPU (more compute); on the
  first GPU pass a verification ran eagerly: 5× a graphed decode step (it now replays a graph of
  its own, engine/cuda_graph.py).

So `StepCosts` times them: the engine reports each pure-decode step's seconds (verification or
plain) and each draft forward's; exponential moving averages (weight 0.2) smooth them. Plain steps
happen when samples are switched off; while everyone speculates, every `recalibrate_every` steps one
step runs plainly so that the plain step's time stays current (the cost of measuring: at most one
step's speculation in 100). Before the first measurements the prior holds: c = the parameter ratio,
v = 1.

`pinned` (LLM(..., speculative_cost=c)) fixes c and v = 1 and times nothing: the controller's
choices, and so a seeded sample at T > 0, then do not depend on the machine's speed. Measured
choices change which random draws a seeded request consumes, never the law of its tokens (the
rejection sampler is exact for every γ), and never greedy output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..engine.outputs import SpecStats
from ..engine.sampler import SamplingParams
from ..engine.sequence import Sequence

EMA_WEIGHT = 0.2  # a new step's weight: about 5 steps of memory
PROBE_BUDGET = 0.03  # a switched-off sample's probes may cost this share of its plain steps
ALPHA_PRIOR = 0.8  # the first sample's α at every position before any verification
# a position's α averages about its last 8 outcomes (an exponential moving average)
ALPHA_MEMORY = 8
MAX_PROBE_INTERVAL = 1024  # the longest wait between probes, after failed probes doubled it


class StepCosts:
    def __init__(self, prior_draft_cost: float, pinned: float | None = None,
                 recalibrate_every: int = 100,
                 one_call: bool = False):
        self.prior = prior_draft_cost
        self.pinned = pinned
        self.recalibrate_every = recalibrate_every
        # the proposer drafts γ tokens in one call (n-gram, Medusa), not γ forwards
        self.one_call = one_call
        self.draft_s: float | None = None  # seconds per draft forward (EMA)
        self.verify_s: float | None = None  # seconds per verification step (EMA)
        self.plain_s: float | None = None  # seconds per plain decode step (EMA)
        self.steps_since_plain = 0

    @property
    def measuring(self) -> bool:
        return self.pinned is None

    def draft_cost(self) -> float:
        """c: a draft forward in plain steps."""
        if self.pinned is not None:
            return self.pinned
        if self.draft_s is None or self.plain_s is None:
            return self.prior
        return self.draft_s / self.plain_s

    def verify_cost(self) -> float:
        """v: a verification in plain steps (1 until both are measured, and when pinned)."""
        if self.pinned is not None or self.verify_s is None or self.plain_s is None:
            return 1.0
        return self.verify_s / self.plain_s

    def step_cost(self, gamma: int) -> float:
        """A speculative step of γ drafts, in plain steps: v + c·γ, or v + c for a one-call proposer
        (1 for γ = 0)."""
        return (
            1.0 if gamma == 0
            else self.verify_cost() + self.draft_cost() * (1 if self.one_call else gamma)
        )

    def wants_plain_step(self) -> bool:
        """Whether the next decode step should run plainly, to time a plain step."""
        return self.measuring and (
            self.plain_s is None or self.steps_since_plain >= self.recalibrate_every
        )

    def record_draft(self, seconds: float, forwards: int) -> None:
        """`forwards` batched draft forwards took `seconds` (0 forwards: n-gram lookup, recorded as
        one)."""
        if self.measuring:
            self.draft_s = _ema(self.draft_s, seconds / max(1, forwards))

    def record_step(self, speculative: bool, seconds: float) -> None:
        """One pure-decode target step (forward, accept or sample) took `seconds`."""
        if not self.measuring:
            return
        if speculative:
            self.verify_s = _ema(self.verify_s, seconds)
            self.steps_since_plain += 1
        else:
            self.plain_s = _ema(self.plain_s, seconds)
            self.steps_since_plain = 0

    def as_dict(self) -> dict:
        return {"draft_cost": self.draft_cost(), "verify_cost": self.verify_cost(),
                "measured": self.measuring,
                "draft_s": self.draft_s, "verify_s": self.verify_s, "plain_s": self.plain_s}


class Stopwatch:
    """Times work queued on a device without waiting for it. On CUDA two events, whose interval is
    read (`seconds`) only after a later sync has passed the second one, as the step's one read of
    its verdicts does; elsewhere the host's clock (torch runs each operation before returning)."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.begin = self._now()
        self.end = self.begin

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self) -> None:
        self.end = self._now()

    def seconds(self) -> float:
        """The interval. On CUDA it waits for the second event first: torch refuses the interval
        of an event not yet reached, and a step whose forward failed never synced."""
        if self.cuda:
            self.end.synchronize()  # (at once after the step's read: it passed `stop` already)
            return self.begin.elapsed_time(self.end) / 1000  # (ms)
        return self.end - self.begin


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * new


def expected_tokens(alphas: list[float], gamma: int) -> float:
    """E[tokens per verification] of γ drafts kept with conditional rates α_1.., stopping at the
    first rejection, plus the bonus token: 1 + α_1 + α_1·α_2 + … + α_1·…·α_γ (= (1 − α^(γ+1)) / (1 −
    α) when every α_i = α)."""
    total, kept = 1.0, 1.0
    for a in alphas[:gamma]:
        kept *= a
        total += kept
    return total


@dataclass
class SampleState:
    gamma: int
    # α_i per draft position (conditional), from observation
    alphas: list[float] = field(default_factory=list)
    # (the first position's α decides the switch-off: a sample whose first draft is rarely kept
    # stops)
    plain_steps: int = 0  # consecutive steps without speculation (switched off)
    probing: bool = False  # this verification is a switched-off sample's probe
    stats: SpecStats = field(default_factory=SpecStats)


class SpecController:
    """γ per sample. A new sample starts from the engine's running α (every verification feeds it),
    so once a draft has shown itself useless the next request does not pay to find out again. When
    no γ is expected to pay (α below `min_acceptance`, or every E(α, γ) / cost(γ) ≤ 1) the sample
    decodes plainly and probes with γ = 1 after `probe_every` plain steps (at first
    `probe_interval`; each failed probe doubles it, up to MAX_PROBE_INTERVAL, one that switches its
    sample back on resets it), and never more often than keeps a probe's extra cost within
    PROBE_BUDGET of the wait."""

    def __init__(self, config, prior_draft_cost: float, one_call: bool = False):
        self.config = config  # nanoserve.config.SpeculativeConfig
        # c and v: measured, or pinned
        self.costs = StepCosts(prior_draft_cost, config.cost, one_call=one_call)
        # the engine's running α_i: a new sample's start
        self.alphas = [ALPHA_PRIOR] * config.num_speculative_tokens
        # plain steps between a switched-off sample's probes
        self.probe_every = config.probe_interval
        self.states: dict[int, SampleState] = {}

    def state(self, seq: Sequence) -> SampleState:
        if seq.seq_id not in self.states:
            st = SampleState(gamma=self.config.num_speculative_tokens, alphas=list(self.alphas))
            if self.config.adaptive:
                st.gamma = self.best_gamma(st.alphas)
            self.states[seq.seq_id] = st
        return self.states[seq.seq_id]

    def wants_plain_step(self) -> bool:
        return self.config.adaptive and self.costs.wants_plain_step()  # a fixed γ needs no clock

    def choose_gamma(self, seq: Sequence, params: SamplingParams, tokens_left: int,
                     max_model_len: int) -> int:
        """This step's γ for a decoding sample (0 = decode plainly)."""
        # a penalty, bias, min-p or min_tokens: the law is not the draft's to check
        if params.reshapes_logits:
            return 0
        st = self.state(seq)
        gamma, probe = st.gamma, False
        # switched off: probe with γ = 1 now and then, its extra cost ≤ PROBE_BUDGET of the wait
        if gamma == 0:
            st.plain_steps += 1
            if st.plain_steps < max(self.probe_every, (self.costs.step_cost(1) - 1) / PROBE_BUDGET):
                return 0
            st.plain_steps, gamma, probe = 0, 1, True
        room = min(tokens_left - 1, max_model_len - len(seq) - 1)  # the bonus token needs room too
        gamma = max(0, min(gamma, room))
        st.probing = probe and gamma > 0
        return gamma

    def observe(self, st: SampleState, drafted: int, accepted: int) -> None:
        """A verification of `drafted` positions (a chain's drafts, a tree's depth) that kept
        `accepted`: the α_i of the positions it tested updated (the sample's and the engine's), then
        γ."""
        if drafted == 0:
            return
        # Position i's draft is a coin tossed only when drafts 1..i−1 were kept: the positions
        # tested are the accepted ones (heads) and the first rejection (tails), if any. The drafts
        # after a rejection were never tested: counting them as failures would underestimate every
        # α.
        if not st.alphas:
            st.alphas = list(self.alphas)
        for i in range(min(drafted, accepted + 1)):
            kept = float(i < accepted)
            st.alphas[i] += (kept - st.alphas[i]) / ALPHA_MEMORY
            self.alphas[i] += (kept - self.alphas[i]) / ALPHA_MEMORY
        if self.config.adaptive:
            st.gamma = self.best_gamma(st.alphas)
        # a failed probe: wait twice as long next time; a good one: back to the start
        if st.probing:
            st.probing = False
            self.probe_every = (min(2 * self.probe_every, MAX_PROBE_INTERVAL) if st.gamma == 0
                                else self.config.probe_interval)

    def best_gamma(self, alphas: list[float]) -> int:
        """argmax over γ of E(γ) / cost(γ); 0 when α_1 < min_acceptance or no γ beats plain
        decoding."""
        if alphas[0] < self.config.min_acceptance:
            return 0
        best, best_gain = 0, 1.0
        for g in range(1, self.config.num_speculative_tokens + 1):
            gain = expected_tokens(alphas, g) / self.costs.step_cost(g)
            if gain > best_gain * (1 + 1e-9):
                best, best_gain = g, gain
        return best

    def free(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)
