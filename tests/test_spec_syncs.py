"""How often a speculative step waits for the device (issue 43, item 4).

On a GPU every read of a device value (`.tolist()`, `int(t)`, `bool(t)`, ...) stalls the host
until the device has caught up. The readable verification reads once per draft token per row
(`greedy_verify`, `rejection_sample`); a draft model's chain read each draft token back before
its next forward. The engine now reads once a step, whatever the batch and γ: the draft chain
stays on the device and the target's verification reads its drafts there (spec/proposers.py,
engine/late_tokens.py), and every row's verdict comes back in one transfer (spec/batch_verify.py),
which tells the host the accepted drafts. This machine has no GPU, so the test counts the calls
themselves with test_no_host_sync's SyncSpy, for greedy and seeded sampled rows; the host-side
building of inputs (`ModelRunner.prepare`) reads CPU tensors by design and is not watched. No
placeholder outlives its step in a target sequence. Negative control: the row-by-row verification
put back is caught. A draft sequence holds placeholders only past where its last chain began.
"""

from __future__ import annotations

import pytest
import torch
from test_no_host_sync import SyncSpy

from nanoserve import SamplingParams
from nanoserve.engine.late_tokens import PLACEHOLDER
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.kv.metadata import CommonAttentionMetadata
from nanoserve.spec import spec_decode
from nanoserve.spec.batch_verify import Verdict
from nanoserve.spec.rejection_sampler import greedy_verify

PROMPTS = ["ROMEO:", "To be, or not to be", "KING", "First Citizen:"]
ONE_READ = [("tolist", "nanoserve.spec.batch_verify")]


def _steady_reads(monkeypatch, params: SamplingParams, gamma: int, batch: int) -> list[list]:
    """Each of three steady speculative steps' reads of device values."""
    engine = LLMEngine.from_kwargs("demo", block_size=4, speculative_model="demo-draft",
                                   num_speculative_tokens=gamma, speculative_adaptive=False)
    for prompt in PROMPTS[:batch]:
        engine.add_request(prompt, params)
    engine.step()  # the prompts, and each first token drawn plainly
    engine.step()  # the draft model catches up with the prompts
    spy = SyncSpy()
    prepare, build = ModelRunner.prepare, CommonAttentionMetadata.build

    monkeypatch.setattr(ModelRunner, "prepare", spy.unwatched(prepare))
    monkeypatch.setattr(CommonAttentionMetadata, "build", staticmethod(spy.unwatched(build)))
    steps = []
    for _ in range(3):
        spy.calls = []
        drafted = sum(s.num_draft_tokens for s in _stats(engine))
        with spy:
            engine.step()
        assert sum(s.num_draft_tokens for s in _stats(engine)) > drafted, "a plain step"
        assert engine.last_num_seqs == batch
        assert all(PLACEHOLDER not in seq.token_ids for seq in engine.scheduler.running)
        proposer = engine.spec.proposer  # a draft sequence's kept drafts learn their ids at _sync
        for target_id, d in proposer.seqs.items():
            assert PLACEHOLDER not in d.token_ids[:proposer.pending.get(target_id, len(d))]
        steps.append(spy.calls)
    monkeypatch.undo()
    return steps


def _stats(engine: LLMEngine) -> list:
    return [r.samples[0].out.spec_stats for r in engine.requests.values()]


@pytest.mark.parametrize("gamma, batch", [(2, 1), (4, 3)])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_speculative_step_reads_the_device_once(monkeypatch, gamma, batch, sampled):
    params = SamplingParams(temperature=0.8 if sampled else 0, seed=5 if sampled else None,
                            max_tokens=60, ignore_eos=True)
    for reads in _steady_reads(monkeypatch, params, gamma, batch):
        assert reads == ONE_READ, reads


def test_negative_control_verifying_row_by_row_reads_per_draft_token(monkeypatch):
    def row_by_row(rows):
        verdicts = []
        for r in rows:
            ids = torch.tensor(r.draft_ids) if r.device_ids is None else r.device_ids
            tokens, accepted = greedy_verify(ids, r.logits)
            verdicts.append(Verdict(tokens, accepted, bool(r.logits.isnan().any())))
        return verdicts

    monkeypatch.setattr(spec_decode, "verify_batch", row_by_row)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with monkeypatch.context() as m:
        steps = _steady_reads(m, params, gamma=4, batch=3)
    assert all(len(reads) > 3 for reads in steps), steps
