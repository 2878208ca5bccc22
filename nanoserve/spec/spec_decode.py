"""Speculative decoding inside the continuous engine: propose, verify in one forward, roll back.

nanoserve/spec/rejection_sampler.py holds the algorithm (the rejection sampler, the n-gram proposer,
a reference loop over toy models). This file runs it on the engine's real pieces, batched across
requests, in each `LLMEngine.step()`:

1. **Which rows.** A row that is decoding (its only new token is its last one) may speculate;
   prefill chunks run as usual beside it. Its γ is the request's own: adaptive (below), capped
   by the tokens it may still generate, the context, and the step's leftover token budget — a
   saturated engine has none left and decodes plainly (speculation buys latency with compute,
   which a full batch no longer has to spare).
2. **Propose.** A *draft model* runs γ small forwards on its own paged KV cache (its own block
   pool, a draft `Sequence` shadowing each target sequence), drafting x₁..x_γ from q at the
   request's temperature / top-k / top-p (greedy: argmax); the drafts stay on the device and join
   the target's sequence as placeholders, which its forward fills there (ModelRunner.late_tokens).
   Or *n-gram lookup* (prompt lookup decoding): copy what followed the latest earlier occurrence
   of the last few tokens — no model.
   Or *Medusa heads* (medusa.py): small heads on the target's own last hidden state, head i's top
   token the i-th draft — no second forward at all; with `speculative_tree`, their top-k candidates
   form a token tree instead of a chain (config/speculative.py, tree_sampler.py). Or *EAGLE's
   head* (eagle.py): one small decoder layer drafting the target's next features, γ calls of it.
3. **Verify.** The drafts are appended to the target sequence (each gets a KV slot through the
   block allocator, copy-on-write included) and the target computes all γ + 1 positions in one
   forward: logits for p₁..p_{γ+1}. Decoding is memory-bound on a GPU, so scoring γ + 1 tokens
   costs about as much as scoring 1.
4. **Accept.** `rejection_sample` keeps x_i with probability min(1, p/q), replaces the first
   rejected one by a draw from normalize(max(p − q, 0)), and adds a bonus token from p_{γ+1} when
   all were kept: between 1 and γ + 1 tokens, distributed exactly as the target alone would
   sample them. Greedy requests use `greedy_verify` (the target's argmax, token for token). The
   engine decides all of a step's chains at once on the device, with the batched forms of both,
   and reads the verdicts back in one transfer (batch_verify.py).
   A tree is verified the same way in one forward: its nodes sit at the root's position + their
   depth and each sees only its ancestors (ModelRunner's `tree_mask`); the walk down the tree
   (tree_sampler.py) keeps the target's law, and the accepted path's K/V moves to the slots right
   after the root (`PagedKVCache.copy_slots`) before the roll back keeps them. Trees are walked
   row by row.
5. **Roll back.** Rejected drafts leave the sequence; `num_computed_tokens` drops to the kept
   prefix (their K/V slots are overwritten later) and blocks past it return to the pool
   (`BlockAllocator.truncate`) — before `mark_computed`, so no block holding a rejected token's
   K/V ever becomes a prefix-cache entry. The draft cache rolls back the same way.

**Adaptive γ and the switch-off** (per sample; spec/controller.py). With acceptance rate α the
expected tokens per verification are E(γ) = (1 − α^(γ+1)) / (1 − α) (Leviathan et al. 2023), at a
cost of v + c·γ plain decode steps: c a draft forward, v the verification, each *measured* on this
engine's own steps (the parameter ratio and v = 1 until then, or `speculative_cost=c` to pin them
and keep seeded outputs independent of the machine's speed). After each verification α is
re-estimated (an exponential moving average) and the next γ is the one maximising E(γ) / (v + c·γ).
When no γ is expected to pay, the sample decodes plainly and probes now and then — so a useless
draft costs a few per cent, not every step.

Requests whose law is more than temperature / top-k / top-p — a penalty (p depends on every
earlier token, drafts included, which the one-forward verification does not model), a logit bias,
min-p or min_tokens (`SamplingParams.reshapes_logits`) — decode plainly. Taught in notebooks/08_*.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch

from ..config import SpeculativeConfig
from ..engine.late_tokens import PLACEHOLDER, LateTokens
from ..engine.logprobs import sampled_logprobs
from ..engine.outputs import SpecStats
from ..engine.sampler import SamplingParams, probs_from_logits
from ..engine.scheduler import Scheduler
from ..engine.sequence import Sequence
from ..errors import NanoserveError, RequestFailedError
from ..models.loader import load_model
from .batch_verify import ChainRow, Verdict, verify_batch
from .controller import SpecController
from .draft_heads import head_proposer
from .proposers import DraftModelProposer, NgramDraft
from .tree_sampler import tree_greedy_verify, tree_positions, tree_rejection_sample


@dataclass
class Proposal:
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator | None
    draft_ids: list[int]
    q: torch.Tensor | None  # [γ, V] draft distributions; None: deterministic (greedy / n-gram)
    start_len: int  # the sequence's length before the drafts were appended
    # a token tree's (node 0: the last token; the drafts are nodes 1..); None: a chain
    parents: list[int] | None = None
    # set by accept: the verification's rows the emitted tokens were drawn from
    logit_rows: list[int] | None = None
    verdict: Verdict | None = None  # a chain's, decided with the step's others (after_forward)
    # [γ] the drafts on the device, where draft_ids holds placeholders (a draft model's chain)
    device_ids: torch.Tensor | None = None


class SpecDecoder:
    """The engine's speculative path: choose γ per row (`plan`), propose and extend, and after the
    target's forward accept and roll back. Owned by LLMEngine; `proposer` is a DraftModelProposer or
    NgramDraft. The target's sequences change only through the target's `scheduler`."""

    def __init__(self, config: SpeculativeConfig, proposer, scheduler: Scheduler,
                 max_model_len: int,
                 cost: float = 0.0, kv=None):
        self.config = config
        self.proposer = proposer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.kv = kv  # the target's PagedKVCache: a verified tree's accepted path moves within it
        # γ per sample (cost: c's prior, the parameter ratio); n-gram lookup and Medusa draft γ
        # tokens in one call
        self.controller = SpecController(config, cost,
                                         one_call=getattr(proposer, "one_call", False))
        # whether the planned step has decoding rows only (its time is recorded)
        self.pure_decode = False
        # copy-on-write block copies from the last extension
        self.copies: list[tuple[int, int]] = []
        # a sequence that finishes (or is aborted) lets go of its state here
        scheduler.on_finish.append(self.free)
        scheduler.on_preempt.append(self.drop_draft)  # recomputed later: its draft cache too
        self._step_start = 0.0  # when the step's forward began (after drafting), for record_step
        self._drafts: dict = {}  # the step's {row: Proposal}
        self._draft_seconds: float | None = None  # the step's drafting, on the host's clock
        # the drafts still on the device, for the target's forward (ModelRunner.late_tokens)
        self.late: LateTokens | None = None

    # ------------------------------------------------------------------ the engine's step hooks
    def before_forward(self, engine, step) -> None:
        """Drafts for the decoding rows that speculate, appended (with KV slots) to their sequences;
        each such row is claimed: it returns 1 + γ logits and `verify_row` handles them. If drafting
        fails, the drafting requests fail and their rows leave the step (one batched draft forward:
        the fault cannot be pinned to a row)."""
        budget = engine.scheduler.config.max_num_batched_tokens - step.sched.num_tokens  # leftover
        rows = self.plan(step.sched, engine.requests, budget)  # [(row, seq, γ, params, generator)]
        proposals = {}
        self._draft_seconds = None
        self.late = None
        if rows:
            proposals = engine.isolated(
                [r[1] for r in rows], step.done, self.draft, step.sched, rows, engine.runner.kv
            )
            if proposals is None:
                step.drop_rows_of(engine.requests)
                proposals = {}
        for row, proposal in proposals.items():
            step.num_logits[row] = 1 + len(proposal.draft_ids)
            step.handlers[row] = partial(self.verify_row, engine, step, proposal)
        if any(p.parents is not None for p in proposals.values()):
            step.trees = self.tree_kwargs(proposals, len(step.sched.seqs))["trees"]
        engine.runner.late_tokens = self.late  # the forward reads the drafts on the device
        self._drafts = proposals
        self._step_start = time.perf_counter()

    def after_forward(self, engine, step, logits: list[torch.Tensor]) -> None:
        """Decide every chain row's verification at once, on the device (batch_verify.py): one
        read for the step. Each row's grammar masks its logits first, one row at a time, so a
        failing grammar fails its request alone; a failing batch fails the rows in it."""
        chains = []
        for row, prop in self._drafts.items():
            if prop.parents is None and prop.seq.request_id in engine.requests:
                chain = engine.isolated([prop.seq], step.done, self._chain_row, engine, prop,
                                        logits[row])
                if chain is not None:
                    chains.append((prop, chain))
        if not chains:
            return
        verdicts = engine.isolated([p.seq for p, _ in chains], step.done, verify_batch,
                                   [c for _, c in chains])
        for (prop, _), verdict in zip(chains, verdicts or []):
            prop.verdict = verdict

    @staticmethod
    def _chain_row(engine, prop: Proposal, logits: torch.Tensor) -> ChainRow:
        req = engine.requests[prop.seq.request_id]
        sample = req.samples[prop.seq.sample_index]
        masked = engine.inputs.grammars.mask_verification(sample.matcher, prop.draft_ids, logits)
        return ChainRow(prop.draft_ids, prop.q, prop.params, prop.generator, masked,
                        prop.device_ids)

    def verify_row(self, engine, step, proposal: Proposal, logits: torch.Tensor) -> None:
        """A claimed row's logits [1 + γ, V]: its chain's verdict (after_forward) or its tree's
        walk, the roll back, and the kept tokens emitted like any step's."""
        seq = proposal.seq
        has_nan = (
            proposal.verdict.has_nan if proposal.parents is None else bool(logits.isnan().any())
        )
        if has_nan:
            raise RequestFailedError("the model produced NaN logits for request "
                                     f"{seq.request_id!r} while verifying its drafts")
        req = engine.requests[seq.request_id]
        tokens = self.accept(proposal, logits)
        lps = sampled_logprobs(logits[proposal.logit_rows], [req.params] * len(tokens), tokens,
                               engine.tokenizer)
        tokens, finished = req.emit_all(req.samples[seq.sample_index], tokens, lps)
        engine.scheduler.postprocess(seq, tokens, finished)
        step.done[seq.request_id] = req.output

    def after_step(self, engine, step) -> None:
        """The step's forward, accept and sample took this long, and its drafting (read now, after
        the step's one sync): the controller's cost estimates."""
        engine.runner.late_tokens = None
        if self._draft_seconds is not None:
            self._record_draft(self._draft_seconds)
        self.record_step(self._drafts, time.perf_counter() - self._step_start)

    # ------------------------------------------------------------------ one step
    def plan(self, sched, requests: dict, budget: int) -> list[tuple]:
        """The rows that speculate this step: (row, seq, γ, params, generator, grammar matcher or
        None) for each decoding row with a γ ≥ 1 that the step's leftover token budget can still pay
        for; none when the controller's clock wants a plain step timed
        (controller.StepCosts.wants_plain_step)."""
        self.pure_decode = all(
            n == 1 and s.num_computed_tokens + 1 == len(s)
            for s, n in zip(sched.seqs, sched.num_new)
        )
        if self.controller.wants_plain_step():
            return []
        rows = []
        for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_new)):
            if n != 1 or seq.num_computed_tokens + 1 != len(seq) or budget <= 0:
                continue  # a prefill chunk, or no budget left
            req = requests[seq.request_id]
            if len(req.samples) < req.params.n:
                continue  # about to fork its samples: the first token is drawn plainly
            s = req.samples[seq.sample_index]
            left = req.max_new - len(s.out.token_ids)
            gamma = min(
                self.controller.choose_gamma(seq, req.params, left, self.max_model_len), budget
            )
            # a tree's nodes are its tokens
            while gamma > 0 and (
                self.tree_size(gamma, s.matcher) > budget
                or len(seq) + self.tree_size(gamma, s.matcher) > self.max_model_len
            ):
                gamma -= 1
            if gamma > 0:
                rows.append((i, seq, gamma, req.params, s.generator, s.matcher))
                budget -= self.tree_size(gamma, s.matcher)
                s.out.spec_stats = self.controller.state(seq).stats
        return rows

    def tree_kwargs(self, proposals: dict, num_rows: int) -> dict:
        """ModelRunner.run's `trees` for a step's {row: Proposal}: given only when some row holds a
        token tree."""
        if all(p.parents is None for p in proposals.values()):
            return {}
        return {
            "trees": [proposals[i].parents if i in proposals else None for i in range(num_rows)]
        }

    def tree_size(self, gamma: int, matcher=None) -> int:
        """The tokens a row drafts at depth γ: γ for a chain, the tree's paths of length ≤ γ for a
        tree (a row under a grammar drafts a chain: its masks follow one path, spec_decode's
        mask_verification)."""
        if self.config.tree is None or matcher is not None:
            return gamma
        return sum(len(c) <= gamma for c in self.config.tree)

    def draft(self, sched, rows: list[tuple], kv) -> dict:
        """Propose for the planned rows, append the drafts to their sequences (copy-on-write copies
        applied to `kv`), and grow each row's token count in `sched`: {row: Proposal} to verify."""
        proposals, start = {}, time.perf_counter()
        extended = self.propose_and_extend([r[1:5] for r in rows], [r[5] for r in rows])
        self._draft_seconds = time.perf_counter() - start
        for (i, *_), prop in zip(rows, extended):
            if prop.draft_ids:
                sched.num_new[i] += len(prop.draft_ids)
                proposals[i] = prop
        for src, dst in self.copies:  # drafts that landed in a shared block
            kv.copy_block(src, dst)
        return proposals

    def propose_and_extend(self, rows, matchers: list | None = None) -> list[Proposal]:
        """rows: (seq, γ, params, generator) with γ ≥ 1, and per row its grammar's matcher
        (structured outputs) or None. Drafts, then appends them to each target sequence with KV
        slots (copy-on-write copies go to `copies`); returns what to verify. A proposal may hold
        fewer drafts than asked (n-gram without a match, a full pool), even none."""
        proposals, self.copies = [], []
        drafted = self.proposer.propose(rows, matchers)
        late: dict[int, tuple[int, int]] = {}  # rows whose drafts are on the device: LateTokens
        for i, ((seq, gamma, params, gen), (draft_ids, q, *tree)) in enumerate(zip(rows, drafted)):
            # a tree's nodes: as many as it has
            start, limit = len(seq), len(draft_ids) if tree else gamma
            # stops early when the pool is full
            kept, copies = self.scheduler.extend(seq, draft_ids[:limit])
            self.copies += copies
            if kept == 0:  # nothing to verify, so no accept() will roll the draft back: do it now
                self.proposer.rollback(seq, start)
            # parents come first: any first nodes form a tree
            parents = tree[0][:kept + 1] if tree else None
            proposal = Proposal(seq, params, gen, draft_ids[:kept], None if q is None else q[:kept],
                                start, parents)
            if kept and PLACEHOLDER in proposal.draft_ids:
                proposal.device_ids = self.proposer.device_drafts[i, :kept]
                late[seq.seq_id] = (i, start)
            proposals.append(proposal)
        if late:
            self.late = LateTokens(self.proposer.device_drafts, late)
        return proposals

    def accept(self, prop: Proposal, logits: torch.Tensor) -> list[int]:
        """The 1..γ+1 tokens to emit: a chain's verdict, or a tree's walk over its logits
        [nodes, V]. Rolls the sequence back (through the scheduler) to its tokens before the drafts,
        with K/V computed through the last accepted draft; the caller emits the returned tokens like
        sampled ones (stop checks, then Scheduler.postprocess), the last of which, as after any
        decode step, still needs its slot."""
        seq, gamma = prop.seq, len(prop.draft_ids)
        if prop.parents is not None:
            tokens, accepted = self._accept_tree(prop, logits)
        else:
            tokens, accepted = prop.verdict.tokens, prop.verdict.accepted
            prop.logit_rows = list(range(len(tokens)))
            self.proposer.rollback(seq, prop.start_len + accepted)
        # Positions start_len − 1 (the old last token) .. start_len − 1 + accepted hold valid K/V.
        self.scheduler.rollback(seq, prop.start_len, prop.start_len + accepted)
        # positions drafted
        depth = gamma if prop.parents is None else max(tree_positions(prop.parents, 0))
        st = self.controller.state(seq)
        st.stats.num_steps += 1
        st.stats.num_draft_tokens += gamma  # (a tree's: its nodes)
        st.stats.num_accepted_tokens += accepted
        st.stats.num_emitted_tokens += len(tokens)
        # (a tree's: a path that stopped short of its depth)
        st.stats.num_rejections += accepted < depth
        self.controller.observe(st, depth, accepted)
        return tokens

    def _accept_tree(self, prop: Proposal, logits: torch.Tensor) -> tuple[list[int], int]:
        """A token tree's verification (tree_sampler.py): the emitted tokens and how many nodes were
        accepted. The accepted path's K/V moves to the positions right after the root (node i sat at
        root + i), where the scheduler's rollback then keeps it; every other node's slot is let go
        of."""
        seq, params, parents = prop.seq, prop.params, prop.parents
        root = prop.start_len - 1  # the old last token's index: node i's token is at root + i
        nodes = [seq.token_ids[root]] + prop.draft_ids
        if params.greedy:
            tokens, path = tree_greedy_verify(parents, nodes, logits)
        else:
            p = probs_from_logits(logits, params.temperature, params.top_k, params.top_p)  # n, V
            tokens, path = tree_rejection_sample(parents, nodes, p, [None] * len(parents),
                                                 prop.generator)
        bs, table = self.kv.block_size, seq.block_table
        slot = lambda i: table[i // bs] * bs + i % bs  # noqa: E731  (a token index's K/V slot)
        moves = [
            (slot(root + node), slot(root + j)) for j, node in enumerate(path, start=1) if node != j
        ]
        if moves:
            self.kv.copy_slots([s for s, _ in moves], [d for _, d in moves])
        prop.logit_rows = [0] + path[:len(tokens) - 1]  # token j was drawn at the node before it
        self.proposer.rollback(seq, prop.start_len + len(path), row=path[-1] if path else 0)
        return tokens, len(path)

    def _record_draft(self, seconds: float) -> None:
        """A draft model's chain of forwards as it timed it (its Stopwatch: on a GPU the device's
        time, read after the step's sync); not when one of them caught up with a new row's prompt
        (a one-off, not what a speculative step costs). n-gram lookup: `seconds`, the whole
        proposal on the host's clock, as one forward."""
        timing = getattr(self.proposer, "timing", None)
        if timing is None:
            self.controller.costs.record_draft(seconds, 1)
            return
        watch, forwards, most_new = timing
        if forwards and most_new <= self.config.num_speculative_tokens + 1:
            self.controller.costs.record_draft(watch.seconds(), forwards)

    def record_step(self, drafts: dict, seconds: float) -> None:
        """The engine's forward, accept and sample of the planned step took `seconds`: timed if it
        decoded only."""
        if self.pure_decode and self.config.adaptive:
            self.controller.costs.record_step(bool(drafts), seconds)

    def drop_draft(self, seq: Sequence) -> None:
        """A preempted sequence will be recomputed: its draft state goes (the controller's
        stays)."""
        self.proposer.free(seq)

    def free(self, seq: Sequence) -> None:
        self.proposer.free(seq)
        self.controller.free(seq)

    def stats(self, seq: Sequence) -> SpecStats | None:
        st = self.controller.states.get(seq.seq_id)
        return None if st is None else st.stats


def build_spec_decoder(cfg: SpeculativeConfig, engine) -> SpecDecoder:
    """The engine's SpecDecoder: an n-gram proposer, or the draft model loaded beside the target
    (one vocabulary, one tokenizer, its own paged KV pool of the target's size)."""
    max_len, kv = engine.max_model_len, engine.runner.kv
    if cfg.method == "ngram":
        # no model: drafting is ~free
        proposer, cost = NgramDraft(cfg.ngram_max, cfg.ngram_min), 0.0
    elif cfg.method in ("medusa", "eagle"):  # heads on the target's own hidden states
        proposer, cost = head_proposer(cfg, engine)
    else:
        try:
            draft, dcfg, dtok = load_model(cfg.draft_model, dtype=engine.dtype,
                                           device=engine.device)
        except NanoserveError as e:
            raise NanoserveError(f"speculative model {cfg.draft_model!r} could not be loaded: "
                                 f"{e}") from e
        if dcfg.vocab_size != engine.config.vocab_size:
            raise NanoserveError(f"the draft model's vocabulary ({dcfg.vocab_size} tokens) differs "
                                 f"from the target's ({engine.config.vocab_size}); speculative "
                                 "decoding needs one shared tokenizer")
        probe = "Speculative decoding needs one shared tokenizer: ÀÉ 123 !?"
        tok = engine.tokenizer
        if dtok is not None and tok is not None and dtok.encode(probe) != tok.encode(probe):
            raise NanoserveError("the draft model's tokenizer encodes text differently from the "
                                 "target's; speculative decoding needs one shared tokenizer")
        max_len = min(max_len, dcfg.max_position_embeddings)
        proposer = DraftModelProposer(draft, kv.num_blocks, kv.block_size, engine.attention_backend)
        # the target replays decode graphs: the draft's decode steps do too
        if engine.cuda_graphs_off is None:
            proposer.runner.use_cuda_graphs(engine.scheduler.config.max_num_seqs, max_len)
        cost = sum(p.numel() for p in draft.parameters()) / sum(
            p.numel() for p in engine.model.parameters()
        )
    return SpecDecoder(cfg, proposer, engine.scheduler, max_len, cost, kv)
