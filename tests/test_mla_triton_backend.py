"""The triton backend over MLA's latent pool (kv/triton_backend.py, `TritonLatentCacheView`): decode
steps run kernels/mla_decode.py over the pool in place, every other step the torch backend's path.

A tiny DeepSeek-V3 (HF's DeepseekV3Config, random weights, YaRN with mscale) runs one schedule of
steps — a prefill, decodes, a 3-token chunk after a cached prefix, decodes, a 2-token chunk — on a
NaN-poisoned pool with the triton backend in Triton's interpreter, and must give the torch
backend's logits (≤ 1e-4, fp32). The kernel's calls are counted (one per layer and decode step,
none elsewhere). Negative controls: a wrong scale handed to the kernel, and the torch path's steps
without the stale slots of each row's last block zeroed (the decode steps zero no fresh block, so
the poison then reaches the gathered, masked slots and the logits turn NaN).
"""

from __future__ import annotations

import nanoserve.kernels.mla_decode as mla_decode_module
import pytest
import torch
import transformers
from family_oracle import load
from testdata import tiny_hf_checkpoint

import nanoserve.kv.triton_backend as triton_backend
from nanoserve.errors import NanoserveError
from nanoserve.kv import KVCache, PagedKVCache
from nanoserve.kv.cache import resolve_attention_backend
from nanoserve.kv.metadata import CommonAttentionMetadata

# H = 4, r = 16, d_rope = 8, d_nope = 12, d_v = 10 (every width distinct), a q bottleneck, YaRN
CONFIG = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, vocab_size=257, max_position_embeddings=256, kv_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, first_k_dense_replace=2,
              q_lora_rank=24, attention_bias=True, initializer_range=0.1,
              rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                   original_max_position_embeddings=64, mscale=0.9,
                                   mscale_all_dim=1.3, beta_fast=32, beta_slow=1))
# new tokens per step: the 2- and 3-token steps attend to a prefix whose last block a decode step
# opened (blocks of 4)
SCHEDULE = [6, 1, 3, 1, 1, 2, 1]
DECODE_STEPS = SCHEDULE.count(1)
TOL = 1e-4


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    transformers.logging.set_verbosity_error()
    path = tmp_path_factory.mktemp("deepseek_v3")
    tiny_hf_checkpoint(transformers.DeepseekV3Config(**CONFIG), path, seed=7)
    return load(path)  # model, cfg


@torch.no_grad()
def _schedule_logits(model, cfg, backend: str, poison: bool = False) -> torch.Tensor:
    """Logits [B, sum(SCHEDULE), V] of two rows run step by step through SCHEDULE."""
    B, total = 2, sum(SCHEDULE)
    ids = torch.randint(0, cfg.vocab_size, (B, total), generator=torch.Generator().manual_seed(0))
    cache = KVCache(cfg, batch_size=B, max_seq_len=total, block_size=4,
                    attention_backend=backend)
    if poison:  # a read past a row's context, or of an unzeroed masked slot, shows as NaN
        cache.pool.k.fill_(float("nan"))
    steps, start = [], 0
    for n in SCHEDULE:
        steps.append(model(ids[:, start:start + n], cache=cache))  # B, n, V
        start += n
    return torch.cat(steps, dim=1)


def _wrap_kernel(monkeypatch, calls: list, scale_factor: float = 1.0) -> None:
    """Replace mla_decode by a wrapper that records each call's batch and scales sm_scale."""
    kernel = mla_decode_module.mla_decode

    def wrapped(q_lat, q_pe, kv_cache, block_tables, context_lens, sm_scale):
        calls.append(q_lat.shape[0])
        return kernel(q_lat, q_pe, kv_cache, block_tables, context_lens, sm_scale * scale_factor)

    monkeypatch.setattr(mla_decode_module, "mla_decode", wrapped)


def test_decode_steps_run_the_kernel_and_match_torch(deepseek, monkeypatch):
    model, cfg = deepseek
    ref = _schedule_logits(model, cfg, "torch")
    calls = []
    _wrap_kernel(monkeypatch, calls)
    got = _schedule_logits(model, cfg, "triton", poison=True)
    assert calls == [2] * (cfg.n_layers * DECODE_STEPS)  # every decode step, every layer, B = 2
    assert torch.isfinite(got).all()
    err = (got - ref).abs().max().item()
    assert err <= TOL, f"max |Δ logits| = {err:.2e}"


def test_negative_control_a_wrong_scale_in_the_kernel_is_caught(deepseek, monkeypatch):
    model, cfg = deepseek
    ref = _schedule_logits(model, cfg, "torch")
    _wrap_kernel(monkeypatch, [], scale_factor=1.5)
    bad = _schedule_logits(model, cfg, "triton")
    assert (bad - ref).abs().max().item() > 1e-2


def test_negative_control_stale_slots_left_unzeroed_leak_nan(deepseek, monkeypatch):
    """Without `stale_slots`, the 3-token step gathers its last block whole, and the slots a decode
    step left unzeroed hold the poison: the logits turn NaN."""
    model, cfg = deepseek
    monkeypatch.setattr(triton_backend, "stale_tail_slots", lambda *args: [])
    bad = _schedule_logits(model, cfg, "triton", poison=True)
    assert not torch.isfinite(bad).all()


def test_stale_tail_slots():
    # blocks of 4: row 0 holds 6 tokens in blocks 5, 2 (block 2's offsets 2, 3 are stale); row 1
    # fills its last block; row 2 holds one token in block 7
    tables = [[5, 2], [1, 3], [7, 0]]
    assert triton_backend.stale_tail_slots(tables, [6, 8, 1], 4) == [10, 11, 29, 30, 31]


def test_what_the_latent_view_cannot_run_is_refused_by_name(deepseek):
    _, cfg = deepseek
    pool = PagedKVCache(cfg, num_blocks=4, block_size=4, attention_backend="triton")
    assert isinstance(pool.bind(_meta(pool, 1)), triton_backend.TritonLatentCacheView)
    view = pool.view(torch.tensor([[0]]), torch.tensor([[0]]), torch.tensor([1]))
    width = cfg.kv_layout.head_dim
    q, k = torch.zeros(1, 1, cfg.n_heads, width), torch.zeros(1, 1, 1, width)
    positions = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(NanoserveError, match="window=4"):
        view.attention(0, q, k, k[..., :16], positions, window=4, scale=0.1)
    with pytest.raises(NanoserveError, match="softcap=30.0"):
        view.attention(0, q, k, k[..., :16], positions, softcap=30.0, scale=0.1)
    # a verification step's CUDA graph hands the Triton backend's metadata to a 2-token step
    common = _common(2)
    graph_meta = triton_backend.TritonCacheView.build_metadata(pool, common)
    with pytest.raises(NotImplementedError, match="enforce_eager=True"):
        triton_backend.TritonLatentCacheView(pool, graph_meta)
    with pytest.raises(NanoserveError, match="float64"):
        resolve_attention_backend("triton", "cpu", width, torch.float64, cfg.kv_layout)


def _common(T: int) -> CommonAttentionMetadata:
    """One row, T new tokens in block 0 from offset 0."""
    return CommonAttentionMetadata.build(torch.arange(T)[None], torch.tensor([[0]]),
                                         torch.tensor([T]))


def _meta(pool: PagedKVCache, T: int):
    return pool.build_metadata(_common(T))
