"""The oracle every model family is held to: transformers on a tiny random checkpoint.

A family's test module (tests/test_family_<name>.py) builds a tiny HF config, saves a random model
with randomised norm weights and biases (testdata.tiny_hf_checkpoint: HF's init leaves them at 1
and 0, where a dropped bias or a wrong epsilon changes nothing) and calls
- `assert_logits_match`: prompt logits, then cached single-token decode steps, each against HF's
  full forward (≤ TOL on fp32 logits), and the model without a cache equal to it with one;
- `assert_engine_matches_hf`: greedy generations through the engine (continuous batching, chunked
  prefill, paged blocks of 4, a prefix-cache hit, past any window) equal HF's generate;
- `assert_every_field_classified`: each key of the installed transformers config class is in the
  family's table (a new transformers field fails until someone decides);
- `logits_delta`: the negative controls — a mechanism removed from the loaded model must move the
  logits by more than TOL (so the match above is not luck).
"""

from __future__ import annotations

from pathlib import Path

import torch

TOL = 1e-4
PROMPTS = [[3, 17, 42, 5, 99, 7], list(range(20, 43)), [9] * 13]


def family_checkpoint(path: Path, config, seed: int):
    """(path, the HF model): a tiny random checkpoint of the HF `config` saved at `path`, norm
    weights and biases randomised (testdata.tiny_hf_checkpoint)."""
    import transformers
    from testdata import tiny_hf_checkpoint

    transformers.logging.set_verbosity_error()
    return path, tiny_hf_checkpoint(config, path, seed=seed)


def load(path: Path):
    from nanoserve.models.loader import load_model

    model, cfg, _ = load_model(path, dtype="float32", device="cpu")
    return model, cfg


def logits_delta(model, cfg, hf, length: int = 24, seed: int = 2) -> float:
    """max |Δ| between nanoserve's and HF's logits on one random prompt of `length` tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, length), generator=generator)
    with torch.no_grad():
        return (model(ids) - hf(ids).logits).abs().max().item()


def assert_logits_match(path: Path, hf, prompt_len: int = 16, steps: int = 20) -> float:
    """Prefill then `steps` cached decode steps against HF's full forward; returns the max |Δ|."""
    from nanoserve.kv import KVCache

    model, cfg = load(path)
    ids = torch.randint(0, min(cfg.vocab_size, 257), (1, prompt_len + steps),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        cache = KVCache(cfg, 1, prompt_len + steps + 8)
        prefill = model(ids[:, :prompt_len], cache=cache)
        errors = [(prefill - ref[:, :prompt_len]).abs().max().item()]
        for t in range(prompt_len, prompt_len + steps):
            step = model(ids[:, t:t + 1], cache=cache)
            errors.append((step[:, 0] - ref[:, t]).abs().max().item())
        full = model(ids)
    print(f"max |Δ| {max(errors):.2e}")  # (pytest -rP shows it: benchmarks/RESULTS.md)
    assert max(errors) <= TOL, f"max |Δ| per step {errors}"
    assert (full - ref).abs().max().item() <= TOL
    return max(errors)


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_engine_matches_hf(path: Path, hf, backends=("torch", "cpu"), max_tokens: int = 40,
                             **llm_kwargs) -> None:
    """Greedy through the engine == HF generate, for every backend: three prompts batched (one
    prefilled in chunks of 16), blocks of 4, then a prompt sharing 16 tokens hits the prefix
    cache."""
    from nanoserve import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    refs = [hf_greedy(hf, p, max_tokens) for p in PROMPTS]
    again = PROMPTS[1][:16] + [5, 6]
    ref_again = hf_greedy(hf, again, max_tokens)
    for backend in backends:
        llm = LLM(str(path), dtype="float32", device="cpu", block_size=4,
                  max_num_batched_tokens=16, attention_backend=backend, **llm_kwargs)
        outs = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
        assert outs == refs, f"backend {backend}: engine tokens differ from HF generate"
        second = llm.generate([again], greedy)[0].token_ids
        assert llm.block_allocator.stats.hits >= 4, f"backend {backend}: no prefix-cache hit"
        assert second == ref_again, f"backend {backend}: tokens after a prefix hit differ"


def assert_every_field_classified(family) -> None:
    import transformers

    config_class = getattr(transformers, family.hf_config_class)
    unclassified = sorted(set(config_class().to_dict()) - set(family.fields))
    assert not unclassified, (f"transformers {transformers.__version__} "
                              f"{family.hf_config_class} has fields {unclassified}: classify each "
                              f"in the {family.model_type} family's table")


def assert_own_layout_refused(path: Path) -> None:
    """A family laid out otherwise than Llama (ModelConfig.arch = its model type): quantization and
    tensor parallelism, which walk Llama's module names, refuse it naming the layout."""
    import pytest

    from nanoserve.errors import NanoserveError
    from nanoserve.parallel.tensor_parallel import check_shardable
    from nanoserve.quant.model import QuantizeConfig, quantize_model

    model, cfg = load(path)
    with pytest.raises(NanoserveError, match=f"not '{cfg.arch}'"):
        quantize_model(model, None, QuantizeConfig(method="rtn"), progress=False)
    with pytest.raises(NanoserveError, match=f"'{cfg.arch}' layout"):
        check_shardable(model, 2)


def assert_saved_checkpoint_reads_back(path: Path, hf, out: Path) -> None:
    """save_checkpoint writes what transformers' own class (the oracle's) loads back to the same
    logits: the family's `to_hf` config and tensor names are right."""
    from nanoserve.models.loader import save_checkpoint

    model, _ = load(path)
    save_checkpoint(model, out)
    again = type(hf).from_pretrained(out).eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert (again(ids).logits - hf(ids).logits).abs().max().item() <= TOL
