"""The tensor-parallel engine (nanoserve/parallel/workers.py): LLM(model, tensor_parallel_size=N) on
gloo, CPU.

The oracle is the same engine on one process (itself proven against HF transformers elsewhere):
greedy tokens equal and logprobs within 1e-4, under continuous batching with prefix-cache hits,
preemption (a pool too small), n = 2 samples (copy-on-write block copies, sent to the workers) — on
GPT-2, a GQA Llama, and a Qwen3 with a sliding window over 4 ranks (2 KV heads for 4 ranks:
replicated). `LLM.logits` equals within 1e-5. Failure and shutdown: a killed worker makes the next
step fail with an error naming it, within the group's timeout, and the engine's group is gone (a new
engine can start); no worker outlives its engine (collected, or its process killed or interrupted).
Refusals are checked by name. The negative control (a rank's all-reduce left out) is
tests/test_tensor_parallel.py's.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from nanoserve import LLM, NanoserveError, SamplingParams
from nanoserve.parallel.workers import WorkerGroupError

PROMPTS = [[5, 17, 99, 3, 42, 8, 77, 1, 64], [5, 17, 99, 3, 42, 8, 77, 1, 64, 23, 11],
           [90, 4, 33, 2, 18, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)


@pytest.fixture(autouse=True)
def _one_group_at_a_time():
    """Each test's engines are collected after it (their workers stopped), so the next may start its
    own group."""
    yield
    gc.collect()
    assert not torch.distributed.is_initialized(), "a tensor-parallel engine outlived its test"


def _run(llm: LLM, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [[c.token_ids for c in o.outputs] for o in outs]
    lps = [
        torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]) for o in outs
        for c in o.outputs if c.logprobs is not None
    ]
    return tokens, lps


def _workers_gone(procs) -> bool:
    for p in procs:
        p.join(timeout=30)
    return not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("case,world", [("gpt2", 2), ("llama-gqa", 2), ("qwen3-window", 4)])
def test_split_engine_equals_one_process(hf_checkpoints, case, world):
    path = str(hf_checkpoints[case][0])
    # too few blocks: preemption
    kw = dict(dtype="float32", block_size=4, num_blocks=24, max_num_seqs=4)
    one = LLM(path, **kw)
    want_tokens, want_lps = _run(one)
    llm = LLM(path, tensor_parallel_size=world, **kw)
    got_tokens, got_lps = _run(llm)
    assert got_tokens == want_tokens
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(got_lps, want_lps))
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_allocator.num_blocks == 24
    # forks: copy-on-write copies
    two = SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True)
    assert _run(llm, PROMPTS[:1], two)[0] == _run(one, PROMPTS[:1], two)[0]
    assert torch.allclose(llm.logits(PROMPTS[1]), one.logits(PROMPTS[1]), atol=1e-5, rtol=1e-5)
    # each rank: its KV heads
    assert llm.engine.runner.kv.k.shape[3] == max(1, one.config.n_kv_heads // world)
    procs = llm.engine.workers.procs
    del llm
    gc.collect()
    assert _workers_gone(procs) and [p.exitcode for p in procs] == [0] * (world - 1)


def test_a_killed_worker_fails_the_engine_by_name_and_nothing_hangs(hf_checkpoints):
    path = str(hf_checkpoints["gpt2"][0])
    llm = LLM(path, dtype="float32", tensor_parallel_size=2)
    worker = llm.engine.workers.procs[0]
    worker.kill()
    worker.join()
    with pytest.raises(WorkerGroupError,
                       match=r"tensor-parallel group failed: rank 1 \(exit code -9\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not torch.distributed.is_initialized()  # the group is gone: another engine may start
    again = LLM(path, dtype="float32", tensor_parallel_size=2)
    assert _run(again, PROMPTS[:1])[0] == _run(LLM(path, dtype="float32"), PROMPTS[:1])[0]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_no_worker_outlives_its_process(hf_checkpoints, tmp_path, how):
    """rank 0's process killed (its workers see their next receive fail) or interrupted (Ctrl-C: the
    exit handler stops them): every worker process ends."""
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(f"""
        import signal, sys, threading
        from nanoserve import LLM
        if __name__ == "__main__":
            # Ctrl-C raises KeyboardInterrupt even where this process was started with SIGINT ignored
            # (a background job of a non-interactive shell, as a CI runner may start the tests)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            llm = LLM({str(hf_checkpoints["gpt2"][0])!r}, dtype="float32", tensor_parallel_size=2)
            print(" ".join(str(p.pid) for p in llm.engine.workers.procs), flush=True)
            threading.Event().wait()  # until a signal ends it
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert pids
    proc.send_signal(getattr(signal, how))
    proc.wait(timeout=120)
    for pid in pids:  # each ends: its pidfd turns readable when it exits (an event, not a poll)
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # already gone
        try:
            ready, _, _ = select.select([fd], [], [], 120)  # the group's timeout is 60 s
        finally:
            os.close(fd)
        assert ready, f"worker {pid} outlived its rank 0"


def test_what_the_split_engine_does_not_run_is_refused_by_name(hf_checkpoints):
    path = str(hf_checkpoints["gpt2"][0])
    for kw, match in [(dict(tensor_parallel_size=0), "must be an integer ≥ 1"),
                      (dict(tensor_parallel_size="2"), "must be an integer ≥ 1"),
                      (dict(tensor_parallel_size=2, speculative="ngram"),
                       "speculative decoding is not supported"),
                      (dict(tensor_parallel_size=2, enable_lora=True),
                       "enable_lora is not supported"),
                      (dict(tensor_parallel_size=3),
                       "not possible for this model: n_heads=4 is not divisible by 3")]:
        with pytest.raises(NanoserveError, match=match):
            LLM(path, dtype="float32", **kw)
    first = LLM(path, dtype="float32", tensor_parallel_size=2)
    with pytest.raises(NanoserveError, match="one split engine per process"):
        LLM(path, dtype="float32", tensor_parallel_size=2)
    assert first.engine.cuda_graphs_off.startswith("tensor parallelism runs eagerly")


def test_the_server_on_a_split_engine_answers_then_503_once_a_worker_died():
    """`nanoserve serve --tensor-parallel-size 2` serves as one process does; a dead worker fails
    the step that finds it (500, the error naming the rank), then the engine is down: every request
    and /health answer 503."""
    import urllib.error
    import urllib.request

    import openai
    from live_server import DEADLINE, LiveServer

    from nanoserve.engine import LLMEngine
    from nanoserve.serving.async_engine import AsyncLLMEngine
    from nanoserve.serving.server import create_app

    core = LLMEngine.from_kwargs("demo", tensor_parallel_size=2)
    srv = LiveServer(create_app(AsyncLLMEngine(core), "demo"))
    try:
        client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=DEADLINE)
        got = client.completions.create(model="demo", prompt="ROMEO:", max_tokens=12,
                                        temperature=0).choices[0].text
        assert got == LLM("demo").generate("ROMEO:", SamplingParams(temperature=0, max_tokens=12),
                                           use_tqdm=False)[0].outputs[0].text
        core.workers.procs[0].kill()
        core.workers.procs[0].join()
        with pytest.raises(openai.InternalServerError, match=r"rank 1 \(exit code -9\)"):
            client.completions.create(model="demo", prompt="ROMEO:", max_tokens=4)
        body = json.dumps({"model": "demo", "prompt": "ROMEO:", "max_tokens": 4}).encode()
        # new connections (a 500 closed the last)
        for path, data in (("/v1/completions", body), ("/health", None)):
            req = urllib.request.Request(f"http://127.0.0.1:{srv.port}{path}", data=data,
                                         headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(req, timeout=DEADLINE)
            assert answer.value.code == 503, path
    finally:
        srv.stop()
        del core, srv


def test_a_quantized_model_is_refused_before_any_worker_starts(hf_checkpoints):
    with pytest.raises(NanoserveError, match="splits float nn.Linear layers, not a"):
        LLM(str(hf_checkpoints["gpt2"][0]), dtype="float32", quantization="int8",
            tensor_parallel_size=2)
    assert not torch.distributed.is_initialized()


def test_torchrun_launches_every_rank_and_rank_0_serves(hf_checkpoints, tmp_path, monkeypatch):
    """`torchrun --nproc-per-node 2 script.py`: both ranks run the script; rank 1 never returns from
    LLM(...) (it follows rank 0, then exits), rank 0 generates, and its tokens are one process's. A
    launch of another size than tensor_parallel_size is refused by name."""
    from nanoserve.parallel.launch import free_port

    path = str(hf_checkpoints["llama-gqa"][0])
    script, out = tmp_path / "script.py", tmp_path / "tokens.json"
    script.write_text(
        textwrap.dedent(f"""
        import json
        from nanoserve import LLM, SamplingParams
        llm = LLM({path!r}, dtype="float32", tensor_parallel_size=2)
        outs = llm.generate({PROMPTS!r}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        open({str(out)!r}, "w").write(json.dumps([o.outputs[0].token_ids for o in outs]))
    """)
    )
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(script)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert json.loads(out.read_text()) == [
        o.outputs[0].token_ids
        for o in LLM(path, dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    ]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(NanoserveError,
                       match="tensor_parallel_size=2 but the launcher started WORLD_SIZE=3"):
        LLM(path, dtype="float32", tensor_parallel_size=2)
