"""Per-request LoRA adapters in the engine (nanoserve/lora/serving.py), against PEFT itself.

Four PEFT adapters (different targets, ranks 4 and 8 in slots of rank 8) and the base model mixed in
one `generate`: each request's greedy tokens must equal PEFT's model for its adapter (HF's for the
base). With two slots for four adapters the scheduler admits at most two adapters at a time, evicts
and reloads, and a base request behind a blocked adapter request still starts at once. The prefix
cache keys on the adapter: the same prompt under another adapter is a miss (negative control: a key
without the adapter hits, and its logprobs miss PEFT's). Bad adapters are refused with their reason
before anything is queued.
"""

from __future__ import annotations

import pytest
import torch
from lora_helpers import TARGETS, hf_greedy, make_peft_adapter

from nanoserve import LLM, LoRARequest, SamplingParams
from nanoserve.errors import CheckpointError, NanoserveError, RequestFailedError
from nanoserve.lora.batched import MultiLoRALinear

peft = pytest.importorskip("peft")

IDS = [5, 17, 99, 3, 42, 8, 77, 1, 64, 23, 11, 90]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


@torch.no_grad()
def _logprob_error(model, prompt: list[int], out) -> float:
    """How far the engine's logprob of each generated token is from `model`'s (an HF or PEFT model,
    scoring prompt + those tokens in one forward): max |Δ| over the tokens."""
    tokens = list(out.outputs[0].token_ids)
    ref = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].double(), -1)  # T, V
    got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
    return max(
        abs(g - ref[len(prompt) - 1 + j, t].item()) for j, (g, t) in enumerate(zip(got, tokens))
    )


def _four_adapters(hf, tmp_path, case):
    """{id: PEFT model}, [LoRARequest]: adapter k targets its own subset of the layers, rank 4 or
    8."""
    models, reqs = {}, []
    targets = TARGETS[case]
    subsets = {1: targets, 2: targets[:1], 3: targets[1:], 4: targets[::2]}
    for k, subset in subsets.items():
        model, path = make_peft_adapter(hf, tmp_path / f"a{k}", subset, seed=10 + k,
                                        r=4 * (1 + k % 2), lora_alpha=8)
        models[k] = model
        reqs.append(LoRARequest(f"adapter-{k}", k, str(path)))
    return models, reqs


@pytest.mark.parametrize("case,method", [("gpt2", None), ("llama-gqa", None), ("gpt2", "gathered"),
                                         ("llama-gqa", "kernel")])
def test_a_batch_mixing_four_adapters_and_the_base_equals_peft_request_by_request(
    hf_checkpoints, tmp_path, case, method
):
    path, hf = hf_checkpoints[case]
    models, reqs = _four_adapters(hf, tmp_path, case)
    prompts = [IDS[i:] + IDS[:i] for i in range(10)]
    which = [1, 2, 3, 4, 0, 2, 1, 0, 4, 3]  # adapter id per prompt, 0: the base
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=8,
              block_size=4)
    # None: the engine's choice (segmented here); the kernel: interpreted
    llm.engine.inputs.lora.method = method
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=[reqs[w - 1] if w else None for w in which])
    for i, (p, w, out) in enumerate(zip(prompts, which, outs)):
        assert out.outputs[0].token_ids == hf_greedy(models[w] if w else hf, p,
                                                     GREEDY.max_tokens), (i, w)
        assert _logprob_error(models[w] if w else hf, p, out) <= 1e-4, (i, w)
        if w:  # the control: a row computed under the wrong adapter (here: none) would miss by far
            assert _logprob_error(hf, p, out) > 1e-2, (i, w)
    # a step of one row, then:
    one = llm.generate([IDS], GREEDY, use_tqdm=False, lora_request=reqs[0])[0]
    # a forward outside the engine is the base model's, not that step's adapter's
    with torch.no_grad():
        base = torch.log_softmax(hf(torch.tensor([IDS])).logits[0].double(), -1)
    assert (torch.log_softmax(llm.logits(IDS).double(), -1) - base).abs().max().item() <= 1e-4
    assert _logprob_error(models[1], IDS, one) <= 1e-4


def test_two_slots_four_adapters_the_scheduler_keeps_at_most_two_running(hf_checkpoints, tmp_path):
    path, hf = hf_checkpoints["llama-gqa"]
    models, reqs = _four_adapters(hf, tmp_path, "llama-gqa")
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    engine, manager = llm.engine, llm.engine.inputs.lora
    order = [1, 2, 3, 0, 4, 1, 0, 3]
    prompts = [IDS[i:] + IDS[:i] for i in range(len(order))]
    rids = [
        engine.add_request(p, GREEDY, lora_request=reqs[w - 1] if w else None)
        for p, w in zip(prompts, order)
    ]
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        running = {s.lora_int_id for s in engine.scheduler.running} - {0}
        assert len(running) <= 2 and len(manager.slot_of) <= 2
        # adapter 3 waits for a slot; the base request behind it does not wait for adapter 3
        if steps == 0:
            assert {s.request_id for s in engine.scheduler.running} >= {rids[0], rids[1], rids[3]}
            assert rids[2] not in {s.request_id for s in engine.scheduler.running}
        steps += 1
    assert manager.loads >= 4  # every adapter had a slot at some point, some after an eviction
    for rid, p, w in zip(rids, prompts, order):
        assert outs[rid].outputs[0].token_ids == hf_greedy(models[w] if w else hf, p,
                                                           GREEDY.max_tokens)
        assert _logprob_error(models[w] if w else hf, p, outs[rid]) <= 1e-4


def test_preempted_requests_come_back_under_their_adapters(hf_checkpoints, tmp_path):
    path, hf = hf_checkpoints["llama-gqa"]
    models, reqs = _four_adapters(hf, tmp_path, "llama-gqa")
    # 9 blocks of 4 tokens; three 12-token prompts growing to 20 need 15: some are preempted and
    # recomputed
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=4, num_blocks=9)
    prompts, which = [IDS, IDS[3:] + IDS[:3], IDS[6:] + IDS[:6]], [1, 2, 0]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=[reqs[w - 1] if w else None for w in which])
    assert llm.engine.scheduler.num_preemptions > 0
    for p, w, out in zip(prompts, which, outs):
        assert _logprob_error(models[w] if w else hf, p, out) <= 1e-4, w


def _first_logprob(llm, prompt, lora_request):
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora_request)[0]
    token = out.outputs[0].token_ids[0]
    return token, out.outputs[0].logprobs[0][token].logprob, out.num_cached_tokens


@pytest.mark.parametrize("adapter_in_key", [True, False])
def test_the_prefix_cache_keys_on_the_adapter(hf_checkpoints, tmp_path, monkeypatch,
                                              adapter_in_key):
    path, hf = hf_checkpoints["llama-gqa"]
    models, reqs = _four_adapters(hf, tmp_path, "llama-gqa")
    # the negative control: block 0 of every sequence hangs from the same root
    if not adapter_in_key:
        monkeypatch.setattr("nanoserve.engine.block_allocator.prefix_root", lambda seq: None)
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=4)
    prompt = IDS  # 12 tokens: two full blocks of 4 may be prefix hits
    want = {}
    for k in (1, 2):
        with torch.no_grad():
            want[k] = torch.log_softmax(
                models[k](torch.tensor([prompt])).logits[0, -1].double(), -1
            )
    _, _, cached = _first_logprob(llm, prompt, reqs[0])
    assert cached == 0
    token, logprob, cached = _first_logprob(llm, prompt, reqs[1])  # the same prompt under adapter 2
    if adapter_in_key:
        assert cached == 0
        assert abs(logprob - want[2][token].item()) <= 1e-4
    else:  # adapter 1's KV served adapter 2's prompt: a hit, and the wrong numbers
        assert cached == 8
        assert abs(logprob - want[2][token].item()) > 1e-3
    # adapter 1 again: its own blocks are hits
    token, logprob, cached = _first_logprob(llm, prompt, reqs[0])
    assert cached == 8
    if adapter_in_key:
        assert abs(logprob - want[1][token].item()) <= 1e-4


def test_bad_adapters_are_refused_before_anything_is_queued(hf_checkpoints, tmp_path):
    path, hf = hf_checkpoints["llama-gqa"]
    _, a4 = make_peft_adapter(hf, tmp_path / "r4", ["q_proj"], seed=1)
    _, a16 = make_peft_adapter(hf, tmp_path / "r16", ["q_proj"], seed=2, r=16, lora_alpha=16)
    plain = LLM(str(path), dtype="float32")
    with pytest.raises(NanoserveError, match="enable_lora=True"):
        plain.generate([IDS], GREEDY, lora_request=LoRARequest("a", 1, str(a4)))
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    cases = [(LoRARequest("big", 2, str(a16)), NanoserveError, "r=16, above max_lora_rank=8"),
             (LoRARequest("zero", 0, str(a4)), NanoserveError,
              "lora_int_id=0 must be an integer ≥ 1"),
             (LoRARequest("gone", 3, str(tmp_path / "missing")), CheckpointError,
              "adapter_config.json is missing"),
             ("a4", NanoserveError, "must be a LoRARequest")]
    for req, err, msg in cases:
        with pytest.raises(err, match=msg):
            llm.generate([IDS], GREEDY, lora_request=req)
    llm.generate([IDS], GREEDY, lora_request=LoRARequest("a", 1, str(a4)))
    with pytest.raises(NanoserveError, match="already names the adapter"):
        llm.generate([IDS], GREEDY, lora_request=LoRARequest("b", 1, str(a16)))
    with pytest.raises(NanoserveError, match="2 lora_request for 1 prompts"):
        llm.generate([IDS], GREEDY, lora_request=[None, None])
    with pytest.raises(NanoserveError, match="max_loras=0"):
        LLM(str(path), dtype="float32", enable_lora=True, max_loras=0)
    assert not llm.engine.has_unfinished_requests() and llm.block_allocator.usage() == 0.0


@torch.no_grad()
def test_one_slot_per_batch_row_equals_one_per_token_row():
    g = torch.Generator().manual_seed(3)
    layer = MultiLoRALinear(torch.nn.Linear(12, 20), num_slots=2, max_rank=4)
    for s in range(2):
        layer.set_adapter(s, torch.randn(4, 12, generator=g), torch.randn(20, 4, generator=g))
    x = torch.randn(3, 5, 12, generator=g)  # B, T, in
    rows = torch.tensor([1, -1, 0])
    layer.set_slots(rows.repeat_interleave(5), [0, 1])
    per_token = layer(x)
    layer.set_slots(rows, [0, 1])
    assert torch.equal(layer(x), per_token)
    layer.set_slots(torch.tensor([1, 0]), [0, 1])  # two slots for three rows: named, not broadcast
    with pytest.raises(ValueError, match="2 slots for an input of shape"):
        layer(x)


@pytest.mark.gpu
def test_on_cuda_the_kernel_serves_the_mixed_batch_and_graphs_step_aside(hf_checkpoints, tmp_path):
    path, hf = hf_checkpoints["llama-gqa"]
    models, reqs = _four_adapters(hf, tmp_path, "llama-gqa")
    llm = LLM(str(path), dtype="float32", device="cuda", enable_lora=True, max_loras=4,
              max_lora_rank=8)
    # slots change per step, layers are wrapped as adapters arrive
    assert "LoRA" in llm.engine.cuda_graphs_off
    prompts, which = [IDS[i:] + IDS[:i] for i in range(5)], [1, 2, 3, 4, 0]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=[reqs[w - 1] if w else None for w in which])
    # kernels/lora_bgmv.py
    assert {layer.method for layer in llm.engine.inputs.lora.layers.values()} == {"kernel"}
    for p, w, out in zip(prompts, which, outs):
        assert _logprob_error(models[w] if w else hf, p, out) <= 1e-3, w


def test_a_forward_that_raises_still_clears_every_layers_slots(hf_checkpoints, tmp_path):
    """LoRA wraps each forward (ModelRunner.around_forward): its slots are cleared whether the
    forward returned or raised, so a later forward is the base model's. The request of the failed
    step fails alone; the engine serves the next one under its adapter."""
    path, hf = hf_checkpoints["gpt2"]
    models, reqs = _four_adapters(hf, tmp_path, "gpt2")
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    engine = llm.engine
    manager = engine.inputs.lora
    seen_slots = []
    real_execute = engine.runner.execute

    def failing_execute(batch):
        seen_slots.extend(layer.slots for layer in manager.layers.values())
        raise RuntimeError("a fault inside the forward")

    engine.runner.execute = failing_execute
    with pytest.raises(RequestFailedError, match="a fault inside the forward"):
        llm.generate([IDS], GREEDY, use_tqdm=False, lora_request=reqs[0])
    # control: the slots were set during the forward, so clearing them is what is tested
    assert len(seen_slots) == len(manager.layers) > 0
    assert all(slots is not None for slots in seen_slots)
    assert all(layer.slots is None for layer in manager.layers.values())
    engine.runner.execute = real_execute
    again = llm.generate([IDS], GREEDY, use_tqdm=False, lora_request=reqs[0])[0]
    assert again.outputs[0].token_ids == hf_greedy(models[1], IDS, GREEDY.max_tokens)
