"""GGUF files (models/gguf_file.py) held to transformers' own GGUF loading of the same file
(`from_pretrained(..., gguf_file=...)`, which dequantizes with the gguf package): a tiny random
Llama (GQA, so q and k are reordered with different head counts), Qwen2 (biases, no reordering),
Qwen3 (q/k norms), Gemma 2 (norms stored as 1 + w, soft caps, a window shorter than the prompt),
Gemma 3 (q/k norms stored as 1 + w too, five sliding layers and a global one, two RoPE bases) and
Phi-3 (fused qkv and gate-up, split at load), written as llama.cpp's converter writes them, in F32,
Q8_0, Q4_0, Q5_1 and the K-quants; logits to 1e-4. The quantized linears stay packed (GGMLLinear,
the file's bytes). Gemma 3's linear RoPE scaling, which transformers' GGUF reader drops, is held to
the transformers model the file was written from. Negative controls: the same Llama file read
without undoing the q/k reordering disagrees, and so do Gemma files whose norms are read as stored,
Phi-3 files whose fused rows are split in another order or whose window is applied, and a scaled
Gemma 3 file read without its scaling."""

from __future__ import annotations

import pytest
import torch
from gguf_writer import close_gguf, write_gguf

from nanoserve.engine.llm import LLM
from nanoserve.errors import CheckpointError, NanoserveError
from nanoserve.models import gguf_file
from nanoserve.models.gguf_file import GGMLLinear

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

IDS = [[3, 17, 92, 5, 250, 41, 8, 8, 77, 130, 2, 64, 256, 82]]


def _hf_model(arch: str, gemma3_rope: dict | None = None):
    torch.manual_seed(0)
    common = dict(vocab_size=257, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    classes = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
               "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
               "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
               "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config),
               "gemma3": (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig),
               "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config)}
    model_class, config_class = classes[arch]
    if arch == "gemma2":  # transformers' GGUF reader takes the soft caps and query scale from
        # Gemma2Config's defaults (50, 30, 256), so those are kept; a window shorter than IDS
        common = {**common, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 8,
                  "num_attention_heads": 2, "num_key_value_heads": 1,
                  "tie_word_embeddings": True}  # as every Gemma 2 (transformers' reader ties it)
    if arch == "gemma3":  # the query scale and the local RoPE base are Gemma3TextConfig's
        # defaults (256, 10,000), as both readers assume; 6 layers: the 6th is the global one, and
        # a window under a third of IDS
        common = {**common, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4,
                  "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 6,
                  "tie_word_embeddings": True, **(gemma3_rope or {})}
    if arch == "phi3":  # a window shorter than IDS that neither reader applies (gguf_file.py,
        # IGNORED_KEYS); a pad id within the vocabulary
        common = {**common, "sliding_window": 4, "pad_token_id": 256,
                  "original_max_position_embeddings": 128}
    model = model_class(config_class(**common))
    with torch.no_grad():  # randomised norms and biases: a loader that drops one is seen
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def _transformers_logits(path) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor(IDS)).logits[0]


def _ours(path) -> torch.Tensor:
    return LLM(str(path), dtype="float32", device="cpu", num_blocks=16).logits(IDS[0])


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q6_K", "Q3_K"])
def test_logits_equal_transformers_gguf_loading(arch, qtype, tmp_path):
    path = write_gguf(_hf_model(arch), tmp_path / f"{arch}-{qtype}.gguf", qtype, arch)
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=16)
    ours = llm.logits(IDS[0])
    assert _max_diff(ours, _transformers_logits(path)) < 1e-4
    packed = [m for m in llm.model.modules() if isinstance(m, GGMLLinear)]
    head = 0 if arch.startswith("gemma") else 1  # Gemma's head is its (float) embedding
    per_block = 7 * llm.model.config.n_layers  # Phi-3's fused three and two split apart
    assert len(packed) == (0 if qtype == "F32" else per_block + head)
    assert all(m.type_name == qtype for m in packed)


def test_negative_control_without_undoing_the_reordering(tmp_path, monkeypatch):
    path = write_gguf(_hf_model("llama"), tmp_path / "llama.gguf", "Q8_0", "llama")
    monkeypatch.setitem(gguf_file.ARCHITECTURES, "llama", ("llama", False))
    assert _max_diff(_ours(path), _transformers_logits(path)) > 1e-2


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_negative_control_gemmas_norms_read_as_stored(arch, tmp_path, monkeypatch):
    path = write_gguf(_hf_model(arch), tmp_path / f"{arch}.gguf", "Q8_0", arch)
    monkeypatch.setattr(gguf_file, "NORM_OFFSET", {})
    assert _max_diff(_ours(path), _transformers_logits(path)) > 1e-2


@pytest.mark.parametrize("fused, wrong_order", [
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.v_proj", "self_attn.k_proj")),
    ("mlp.gate_up_proj", ("mlp.up_proj", "mlp.gate_proj")),
])
def test_negative_control_phi3_fused_rows_split_in_another_order(fused, wrong_order, tmp_path,
                                                                  monkeypatch):
    """k and v (gate and up) have as many rows each, so only the values can tell the order."""
    path = write_gguf(_hf_model("phi3"), tmp_path / "phi3.gguf", "Q8_0", "phi3")
    monkeypatch.setitem(gguf_file.FUSED_PARTS, fused, wrong_order)
    assert _max_diff(_ours(path), _transformers_logits(path)) > 1e-2


def test_negative_control_phi3_window_applied(tmp_path, monkeypatch):
    """The file's window (4, shorter than IDS) is one neither transformers nor llama.cpp applies;
    reading it as HF's sliding_window disagrees with them."""
    path = write_gguf(_hf_model("phi3"), tmp_path / "phi3.gguf", "F32", "phi3")
    monkeypatch.setattr(gguf_file, "IGNORED_KEYS", {})
    assert _max_diff(_ours(path), _transformers_logits(path)) > 1e-2


GEMMA3_LINEAR = {"rope_parameters": {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}


def test_gemma3_linear_rope_scaling_equals_the_source_model(tmp_path):
    """Gemma 3 4B-27B scale the global layers' positions by 1/8 (rope.scaling.type linear, factor
    8), which transformers' GGUF reader drops: the reference is the transformers model the F32 file
    was written from."""
    model = _hf_model("gemma3", GEMMA3_LINEAR)
    path = write_gguf(model, tmp_path / "gemma3-linear.gguf", "F32", "gemma3")
    with torch.no_grad():
        source = model(torch.tensor(IDS)).logits[0]
    assert _max_diff(_ours(path), source) < 1e-4


def test_negative_control_gemma3_rope_scaling_dropped(tmp_path, monkeypatch):
    model = _hf_model("gemma3", GEMMA3_LINEAR)
    path = write_gguf(model, tmp_path / "gemma3-linear.gguf", "F32", "gemma3")
    with torch.no_grad():
        source = model(torch.tensor(IDS)).logits[0]
    monkeypatch.setattr(gguf_file, "rope_scaling_from_gguf", lambda meta, prefix: None)
    assert _max_diff(_ours(path), source) > 1e-2


def _copy_with(path, out, add_keys) -> None:
    """The GGUF file at `path` rewritten to `out` with the keys `add_keys(writer)` adds."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    add_keys(writer)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())),
                          raw_dtype=t.tensor_type)
    close_gguf(writer)


def _yarn(writer) -> None:
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)


def _longrope(writer) -> None:  # what the converter writes for Phi-3 128k (and two tensors)
    writer.add_rope_scaling_attn_factors(1.19)


@pytest.mark.parametrize("arch, add_keys, key", [("llama", _yarn, "llama.rope.scaling.type"),
                                                 ("phi3", _longrope,
                                                  "phi3.rope.scaling.attn_factor")])
def test_an_unread_key_is_refused_by_name(arch, add_keys, key, tmp_path):
    path = write_gguf(_hf_model(arch), tmp_path / f"{arch}.gguf", "F32", arch)
    _copy_with(path, tmp_path / "with-scaling.gguf", add_keys)
    with pytest.raises(CheckpointError, match=key):
        LLM(str(tmp_path / "with-scaling.gguf"), dtype="float32", device="cpu", num_blocks=16)


def test_the_files_tokenizer_is_transformers(tmp_path):
    """The tokenizer comes from the file's own metadata, as transformers builds it."""
    path = write_gguf(_hf_model("llama"), tmp_path / "llama.gguf", "Q8_0", "llama")
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=16)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ("ROMEO:\nWhat light?", "ünï 日本 <|endoftext|>x", "  two  spaces"):
        assert llm.encode_prompt(text) == hf(text)["input_ids"]
    assert llm.tokenizer.eos_id == hf.eos_token_id == 256


def test_a_missing_key_is_named(tmp_path):
    import gguf

    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    close_gguf(writer)
    with pytest.raises(CheckpointError, match="lacks 'llama.context_length'"):
        LLM(str(path), dtype="float32", device="cpu", num_blocks=16)


@pytest.mark.shared
def test_another_tokenizer_replaces_the_files(tmp_path):
    """`tokenizer=` (vLLM's --tokenizer) is used instead of the file's own vocabulary: the demo's
    folder works (the same 257 ids); GPT-2's 50,257-token vocabulary is refused by the check that
    every id is a row of the model's 257-row embedding — so it was the one read."""
    from testdata import shared_path

    from nanoserve.models.loader import resolve_model_path

    path = write_gguf(_hf_model("llama"), tmp_path / "llama.gguf", "Q8_0", "llama")
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=16,
              tokenizer=str(resolve_model_path("demo")))
    assert llm.encode_prompt("ROMEO:") == list(b"ROMEO:")
    with pytest.raises(NanoserveError, match="vocab"):
        LLM(str(path), dtype="float32", device="cpu", num_blocks=16,
            tokenizer=str(shared_path("models", "gpt2-tokenizer")))
