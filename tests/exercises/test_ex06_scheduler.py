"""Exercise 6: one continuous-scheduler step (nanoserve/engine/scheduler.py: Scheduler.schedule,
_tokens_to_compute, _pick_victim, _preempt).

No model is needed: the scheduler never touches tensors. `Engine` below plays LLMEngine.step's
bookkeeping by hand (each scheduled sequence computes its tokens; one that reaches its end gets a
token appended and then needs a slot, or finishes). Oracles: step-by-step plans worked out by
hand for small workloads (who runs, how many tokens, who is preempted), and invariants checked
at every step of random workloads: the budget and max_num_seqs hold, running sequences come
before admissions, a step that preempts admits nobody, a victim keeps its tokens but no blocks or
KV and waits in sorted order, the pool's count adds up, nothing admissible is left waiting while
budget remains, and every request finishes with all its tokens within a bounded number of steps.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from explain import explained_failure

import nanoserve.engine.scheduler
from nanoserve.engine.block_allocator import BlockAllocator
from nanoserve.engine.scheduler import SchedulerConfig
from nanoserve.engine.sequence import Sequence, SequenceStatus

REFERENCE = "nanoserve.engine.scheduler"
EXERCISE = "scheduler"
pytestmark = pytest.mark.ex06

BS = 4


def make(impl, num_blocks=64, budget=16, max_seqs=8, chunked=True, max_model_len=64):
    """impl's Scheduler over a fresh pool (prefix caching off: every prompt block is computed)."""
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                             enable_chunked_prefill=chunked)
    return impl.Scheduler(config, BlockAllocator(num_blocks, BS, enable_prefix_caching=False),
                          max_model_len)


class Engine:
    """LLMEngine.step's bookkeeping around `sched.schedule()`, with the forward played by hand."""

    def __init__(self, sched):
        self.sched, self.block_allocator = sched, sched.block_allocator
        self.left: dict[Sequence, int] = {}  # tokens still to generate
        self.by_name: dict[str, Sequence] = {}
        self.finished: list[Sequence] = []
        self.steps = 0

    def add(self, name, prompt_len, max_tokens, priority=0):
        seq = Sequence([7] * prompt_len, request_id=name, arrival_time=float(len(self.by_name)),
                       priority=priority)
        self.left[seq], self.by_name[name] = max_tokens, seq
        self.sched.add(seq)
        return seq

    def step(self):
        """One step; returns ([(name, new tokens)], [names preempted])."""
        sched = self.sched
        running_before = list(sched.running)
        out = sched.schedule()
        self.steps += 1
        check_step(sched, out, running_before)
        for seq, n in zip(out.seqs, out.num_new):  # the forward computes their KV
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == len(seq):  # the last token's logits: sample one more
                seq.append_token(7)
                self.left[seq] -= 1
                if self.left[seq] == 0:
                    sched.finish(seq)
                    self.finished.append(seq)
                else:
                    seq.needs_slot = True
        alloc = self.block_allocator
        assert (
            sum(len(s.block_table) for s in sched.running)
            == alloc.num_blocks - alloc.num_free_blocks()
        ), "the running sequences' blocks and the free count disagree"
        return [(s.request_id, n) for s, n in zip(out.seqs, out.num_new)], [
            s.request_id for s in out.preempted
        ]

    def run(self, max_steps):
        while self.sched.has_unfinished():
            assert self.steps < max_steps, f"not finished after {max_steps} steps"
            self.step()
        assert sorted(self.finished, key=lambda s: s.seq_id) == sorted(
            self.left, key=lambda s: s.seq_id
        ), "a request was lost"
        assert all(n == 0 for n in self.left.values())
        assert self.block_allocator.num_free_blocks() == self.block_allocator.num_blocks, (
            "blocks leaked"
        )


def check_step(sched, out, running_before):
    """What every step must satisfy, whatever the workload."""
    cfg, bm = sched.config, sched.block_allocator
    assert out.num_tokens <= cfg.max_num_batched_tokens, (
        f"a step's tokens: expected at most the budget, {cfg.max_num_batched_tokens}, got "
        f"{out.num_tokens}")
    assert len(out.seqs) <= cfg.max_num_seqs and len(set(out.seqs)) == len(out.seqs)
    for seq, n in zip(out.seqs, out.num_new):
        assert seq in sched.running and seq.status == SequenceStatus.RUNNING and not seq.needs_slot
        assert 1 <= n <= len(seq) - seq.num_computed_tokens, f"{n} tokens for {seq.request_id}"
        assert len(seq.block_table) == bm.blocks_needed(len(seq)), (
            f"{seq.request_id} has no slot for its tokens"
        )
        if not cfg.enable_chunked_prefill:
            assert n == len(seq) - seq.num_computed_tokens, (
                "without chunked prefill a prompt runs whole"
            )
    admitted = [s for s in out.seqs if s not in running_before]
    kept = [s for s in running_before if s not in out.preempted]
    assert out.seqs[:len(out.seqs) - len(admitted)] == [s for s in kept if s in out.seqs], \
        "running sequences first, in admission order"
    assert not (admitted and out.preempted), (
        f"a step that preempted {[s.request_id for s in out.preempted]}: expected no admission, "
        f"got {[s.request_id for s in admitted]} admitted")
    left = cfg.max_num_batched_tokens - out.num_tokens
    if admitted or left > 0:
        missing = [s.request_id for s in kept if s not in out.seqs]
        assert not missing, (
            f"a step with admissions or {left} tokens of budget left: expected every running "
            f"sequence in it, got {missing} left out")
    for seq in out.preempted:
        assert (
            seq not in sched.running and seq in sched.waiting
            and seq.status == SequenceStatus.WAITING
        )
        assert seq.block_table == [] and seq.num_computed_tokens == 0 and not seq.needs_slot, (
            f"preempted {seq.request_id}: expected no blocks and 0 computed tokens (recompute), "
            f"got blocks {seq.block_table} and {seq.num_computed_tokens} computed tokens")
    keys = [s.sort_key for s in sched.waiting]
    assert keys == sorted(keys) and all(not s.block_table for s in sched.waiting)
    if not out.preempted and left > 0 and sched.waiting and len(sched.running) < cfg.max_num_seqs:
        head = sched.waiting[0]
        assert not bm.can_allocate(head) or (not cfg.enable_chunked_prefill and len(head) > left), \
            f"{head.request_id} could have been admitted with {left} tokens of budget left"


# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
def check_tokens_to_compute(impl):
    for chunked, budget, computed, want in [
            (True, 4, 3, 4), (True, 7, 3, 7), (True, 8, 3, 7), (True, 1, 9, 1), (True, 16, 0, 10),
            (False, 6, 3, 0), (False, 7, 3, 7), (False, 100, 0, 10), (False, 9, 0, 0)]:
        sched = make(impl, chunked=chunked, budget=16 if chunked else 64)
        seq = Sequence(list(range(10)))
        seq.num_computed_tokens = computed
        got = sched._tokens_to_compute(seq, budget)
        assert got == want, (
            f"_tokens_to_compute(10 tokens, {computed} computed, budget {budget}, chunked "
            f"prefill {'on' if chunked else 'off'}): expected {want}, got {got}")


def check_pick_victim(impl):
    sched = make(impl)
    for priorities, index, want in [([0, 0, 0], 0, 2), ([0, 0, 0], 2, 2), ([0, 2, 1, 2, 0], 0, 3),
                                    ([0, 2, 1, 2, 0], 4, 4), ([1, 0, 0], 0, 0), ([1, 0, 0], 1, 2)]:
        sched.running = [Sequence([1], priority=p) for p in priorities]
        got = sched.running.index(sched._pick_victim(index))
        assert got == want, (
            f"_pick_victim({index}) with running priorities {priorities} (admission order): "
            f"expected the sequence at {want}, got the one at {got}")


def check_preempt(impl):
    sched = make(impl, num_blocks=8)
    a, b, late = (
        Sequence(list(range(n)), arrival_time=t) for n, t in [(6, 0.0), (5, 1.0), (3, 5.0)]
    )
    for seq in (a, b):
        sched.block_allocator.allocate(seq)
        seq.num_computed_tokens = len(seq)
        sched.add_running(seq)
    sched.add(late)
    a.append_token(9)
    a.needs_slot = True
    sched._preempt(a)
    assert sched.running == [b] and sched.waiting == [a, late], (
        "_preempt(A) of running [A, B] with [late] waiting: expected running [B], waiting "
        f"[A, late] (arrival order), got {sched.running} and {sched.waiting}")
    assert a.status == SequenceStatus.WAITING and len(a) == 7, (
        "_preempt(A): expected A WAITING with its 7 tokens (prompt + generated), got "
        f"{a.status.name} with {len(a)}")
    assert a.block_table == [] and a.num_computed_tokens == 0, (
        "_preempt(A), recompute: expected no blocks and 0 computed tokens, got blocks "
        f"{a.block_table} and {a.num_computed_tokens} computed")
    assert not a.needs_slot and a.num_preemptions == 1 == sched.num_preemptions
    assert sched.block_allocator.num_free_blocks() == 8 - len(b.block_table)
    sched._preempt(b)
    assert sched.running == [] and sched.waiting == [a, b, late] and sched.num_preemptions == 2
    assert sched.block_allocator.num_free_blocks() == 8
    sched.block_allocator.check_invariants()


def check_plans(engine, want):
    for plan, preempted in want:
        got = engine.step()
        assert got == (plan, preempted), (
            f"step {engine.steps}, as ([(sequence, tokens)], [preempted]): expected "
            f"{(plan, preempted)}, got {got}")


def check_budget_and_running_first(impl):
    """16 tokens and 3 sequences per step: A and B's chunk fill step 1; running ones go first; D
    waits for a seat."""
    engine = Engine(make(impl, budget=16, max_seqs=3))
    for name, prompt, out in [("A", 7, 3), ("B", 23, 2), ("C", 5, 2), ("D", 4, 2)]:
        engine.add(name, prompt, out)
    check_plans(engine, [([("A", 7), ("B", 9)], []),
                         ([("A", 1), ("B", 14), ("C", 1)], []),
                         ([("A", 1), ("B", 1), ("C", 4)], []),  # D waits: 3 sequences run
                         ([("C", 1), ("D", 4)], []),  # A and B finished: D is admitted at once
                         ([("D", 1)], [])])
    engine.run(max_steps=5)


def check_chunked_prefill(impl):
    """A 40-token prompt in chunks of what the budget leaves, next to a decoding sequence."""
    engine = Engine(make(impl, budget=16))
    engine.add("Q", 3, 4)
    engine.add("P", 40, 2)
    check_plans(engine, [([("Q", 3), ("P", 13)], []), ([("Q", 1), ("P", 15)], []),
                         ([("Q", 1), ("P", 12)], []), ([("Q", 1), ("P", 1)], [])])
    engine.run(max_steps=4)
    engine = Engine(make(impl, budget=64, chunked=False, max_model_len=64))  # whole prompts only
    engine.add("P", 40, 2)
    engine.add("Q", 30, 2)
    check_plans(engine, [([("P", 40)], []), ([("P", 1), ("Q", 30)], []), ([("Q", 1)], [])])
    engine.run(max_steps=3)


def check_preemption(impl):
    """4 blocks of 4: A, B and C fill the pool; each decode token then needs a block: C, the newest,
    is preempted and recomputes its 9 tokens (prompt + 1 generated) once A and B are done."""
    engine = Engine(make(impl, num_blocks=4, budget=16, max_seqs=4))
    for name, prompt, out in [("A", 4, 3), ("B", 4, 3), ("C", 8, 3), ("D", 4, 1)]:
        engine.add(name, prompt, out)
    check_plans(engine, [([("A", 4), ("B", 4), ("C", 8)], []), ([("A", 1), ("B", 1)], ["C"])])
    c, d = engine.by_name["C"], engine.by_name["D"]
    assert engine.sched.waiting == [c, d], "the victim waits at the front (it arrived before D)"
    assert (
        len(c) == 9 and c.block_table == [] and c.num_computed_tokens == 0
        and c.num_preemptions == 1
    )
    assert engine.sched.num_preemptions == 1
    check_plans(engine, [([("A", 1), ("B", 1)], []),  # C needs 3 blocks, none is free
                         ([("C", 9), ("D", 4)], []),  # recompute: prompt + generated token
                         ([("C", 1)], [])])
    engine.run(max_steps=5)


def check_priority(impl):
    """Waiting sequences start in (priority, arrival) order; the victim is the lowest priority, then
    the newest (possibly the sequence that needs the block: then the next one still runs)."""
    engine = Engine(make(impl, max_seqs=1))
    for name, prio in [("p5", 5), ("p0", 0), ("p3", 3), ("p1", 1)]:
        engine.add(name, 2, 1, priority=prio)
    started = [engine.step()[0][0][0] for _ in range(4)]
    assert started == ["p0", "p1", "p3", "p5"], f"started in the order {started}"
    engine = Engine(make(impl, num_blocks=3, budget=16))
    engine.add("R", 3, 4, priority=0)
    engine.add("L", 3, 4, priority=2)
    check_plans(engine, [([("R", 3), ("L", 3)], [])])
    engine.add("N", 3, 2, priority=1)  # arrives later, with a higher priority than L
    check_plans(engine, [([("R", 1), ("L", 1), ("N", 3)], []),
                         # R needs a block: L, not the newer N, gives way
                         ([("R", 1), ("N", 1)], ["L"])])
    engine.run(max_steps=30)
    engine = Engine(make(impl, num_blocks=2, budget=16))
    engine.add("L", 3, 3, priority=2)
    check_plans(engine, [([("L", 3)], [])])
    engine.add("H", 3, 2, priority=0)
    check_plans(engine, [([("L", 1), ("H", 3)], []),
                         # L needs a block and is the victim itself: H, next in line, still runs
                         ([("H", 1)], ["L"])])
    engine.run(max_steps=30)


def check_random_workloads(impl, seeds=range(30)):
    """Random requests (some arriving mid-run), priorities, pools barely large enough, budgets and
    caps; every step checked (check_step), every request finished, every block back."""
    preemptions = chunks = 0
    for seed in seeds:
        rng = random.Random(seed)
        chunked = seed % 4 != 3
        budget = rng.choice([4, 8, 16, 32]) if chunked else 32
        # name, prompt, output, priority
        specs = [(f"r{i}", rng.randint(1, 20), rng.randint(1, 10), rng.randint(0, 2))
                 for i in range(rng.randint(4, 12))]
        longest = max(prompt + out for _, prompt, out, _ in specs)
        num_blocks = -(-longest // BS) + rng.randint(0, 6)
        engine = Engine(make(impl, num_blocks, budget, rng.randint(1, 6), chunked,
                             max_model_len=32))
        # at which step
        arrivals = [0] * (len(specs) // 2) + [rng.randrange(10) for _ in specs[len(specs) // 2:]]
        for step in range(10):
            for when, spec in zip(arrivals, specs):
                if when == step:
                    engine.add(*spec)
            if engine.sched.has_unfinished():
                engine.step()
            chunks += sum(
                0 < s.num_computed_tokens < s.num_prompt_tokens for s in engine.sched.running
            )
        total = sum(prompt + out for _, prompt, out, _ in specs)
        engine.run(max_steps=10 + 2 * total)
        preemptions += engine.sched.num_preemptions
    assert preemptions > 0 and chunks > 0, "the workloads were meant to preempt and to chunk"


# ----------------------------------------------------------------------------- the tests
def test_ex06_1_tokens_to_compute_with_and_without_chunked_prefill(impl):
    check_tokens_to_compute(impl)


def test_ex06_2_the_victim_is_the_lowest_priority_then_the_newest(impl):
    check_pick_victim(impl)


def test_ex06_3_preemption_frees_the_blocks_and_requeues_for_recompute(impl):
    check_preempt(impl)


def test_ex06_4_budget_max_num_seqs_and_running_first(impl):
    check_budget_and_running_first(impl)


def test_ex06_4_chunked_prefill_splits_a_long_prompt(impl):
    check_chunked_prefill(impl)


def test_ex06_4_preemption_when_the_pool_runs_dry(impl):
    check_preemption(impl)


def test_ex06_4_priority_orders_admission_and_preemption(impl):
    check_priority(impl)


def test_ex06_4_random_workloads_all_finish(impl):
    check_random_workloads(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _schedule(after_self_preemption="stay", admit_after_preemption=False):
    def schedule(self):
        out = nanoserve.engine.scheduler.SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.needs_slot and not self._make_room(seq, i, out):
                i += after_self_preemption == "advance"
                continue
            n = self._tokens_to_compute(seq, budget)
            if n:
                out.add(seq, n)
                budget -= n
            i += 1
        if out.preempted and not admit_after_preemption:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            too_long = not self.config.enable_chunked_prefill and len(seq) > budget
            if too_long or not self.block_allocator.can_allocate(seq):
                break
            self.block_allocator.allocate(seq)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = self._tokens_to_compute(seq, budget)
            out.add(seq, n)
            budget -= n
        return out
    return schedule


def _tokens_to_compute(slack):
    def _tokens_to_compute(self, seq, budget):
        need = len(seq) - seq.num_computed_tokens
        if self.config.enable_chunked_prefill:
            return min(need, budget + slack)
        return need if need <= budget + slack else 0
    return _tokens_to_compute


def _pick_victim(key):
    def _pick_victim(self, index):
        return max(self.running[index:], key=lambda s: key(s.priority, self.running.index(s)))
    return _pick_victim


def _preempt(recompute):
    def _preempt(self, seq):
        self.running.remove(seq)
        if recompute:
            self.block_allocator.free(seq)
        seq.needs_slot = False
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)
    return _preempt


RIGHT = {"schedule": _schedule(), "_tokens_to_compute": _tokens_to_compute(slack=0),
         "_pick_victim": _pick_victim(lambda priority, position: (priority, position)),
         "_preempt": _preempt(recompute=True)}


def _variant(**wrong):
    """nanoserve's scheduler with the four methods above, right unless overridden."""
    return SimpleNamespace(Scheduler=type("Variant", (nanoserve.engine.scheduler.Scheduler,),
                                          {**RIGHT, **wrong}))


WRONG = {
    "preemption without recompute (keeps its blocks and KV)": (
        _variant(_preempt=_preempt(recompute=False)),
        [check_preempt, check_preemption, check_random_workloads]),
    "budget overrun by one": (_variant(_tokens_to_compute=_tokens_to_compute(slack=1)),
                              [check_tokens_to_compute, check_budget_and_running_first,
                               check_chunked_prefill,
                               check_random_workloads]),
    "victim = the oldest, not the newest": (
        _variant(_pick_victim=_pick_victim(lambda priority, position: (priority, -position))),
        [check_pick_victim, check_preemption]),
    "victim = the newest, whatever its priority": (
        _variant(_pick_victim=_pick_victim(lambda priority, position: position)),
        [check_pick_victim, check_priority]),
    "schedule skips the next sequence after one preempts itself": (
        _variant(schedule=_schedule(after_self_preemption="advance")), [check_priority]),
    "schedule admits in a step that preempted": (
        _variant(schedule=_schedule(admit_after_preemption=True)), [check_random_workloads]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex06_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex06_the_checks_pass_on_a_right_variant_built_the_same_way():
    """The mutants differ from this one in exactly one place, so their failures are that place's."""
    right = _variant()
    for check in (check_tokens_to_compute, check_pick_victim, check_preempt,
                  check_budget_and_running_first,
                  check_chunked_prefill, check_preemption, check_priority, check_random_workloads):
        check(right)
