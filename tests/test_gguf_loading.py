"""GGUF files (models/gguf_file.py) held to transformers' own GGUF loading of the same file
(`from_pretrained(..., gguf_file=...)`, which dequantizes with the gguf package): a tiny random
Llama (GQA, so q and k are reordered with different head counts), Qwen2 (biases, no reordering),
Qwen3 (q/k norms) and Gemma 2 (norms stored as 1 + w, soft caps, a window shorter than the
prompt), written as llama.cpp's converter writes them, in F32, Q8_0, Q4_0, Q5_1 and the K-quants;
logits to 1e-4. The quantized linears stay packed (GGMLLinear, the file's bytes). Negative
controls: the same Llama file read without undoing the q/k reordering disagrees, and so does a
Gemma 2 file whose norms are read as stored."""

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


def _hf_model(arch: str):
    torch.manual_seed(0)
    common = dict(vocab_size=257, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    classes = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
               "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
               "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
               "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config)}
    model_class, config_class = classes[arch]
    if arch == "gemma2":  # transformers' GGUF reader takes the soft caps and query scale from
        # Gemma2Config's defaults (50, 30, 256), so those are kept; a window shorter than IDS
        common = {**common, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 8,
                  "num_attention_heads": 2, "num_key_value_heads": 1,
                  "tie_word_embeddings": True}  # as every Gemma 2 (transformers' reader ties it)
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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2"])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q6_K", "Q3_K"])
def test_logits_equal_transformers_gguf_loading(arch, qtype, tmp_path):
    path = write_gguf(_hf_model(arch), tmp_path / f"{arch}-{qtype}.gguf", qtype, arch)
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=16)
    ours = llm.logits(IDS[0])
    assert (ours - _transformers_logits(path)).abs().max().item() < 1e-4
    packed = [m for m in llm.model.modules() if isinstance(m, GGMLLinear)]
    head = 0 if arch == "gemma2" else 1  # Gemma's head is its (float) embedding
    assert len(packed) == (0 if qtype == "F32" else 2 * 7 + head)  # 7 per block, and the head
    assert all(m.type_name == qtype for m in packed)


def test_negative_control_without_undoing_the_reordering(tmp_path, monkeypatch):
    path = write_gguf(_hf_model("llama"), tmp_path / "llama.gguf", "Q8_0", "llama")
    monkeypatch.setitem(gguf_file.ARCHITECTURES, "llama", ("llama", False))
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=16)
    assert (llm.logits(IDS[0]) - _transformers_logits(path)).abs().max().item() > 1e-2


def test_negative_control_gemmas_norms_read_as_stored(tmp_path, monkeypatch):
    path = write_gguf(_hf_model("gemma2"), tmp_path / "gemma2.gguf", "Q8_0", "gemma2")
    monkeypatch.setattr(gguf_file, "NORM_OFFSET", {})
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=16)
    assert (llm.logits(IDS[0]) - _transformers_logits(path)).abs().max().item() > 1e-2


def test_an_unread_key_is_refused_by_name(tmp_path):
    import gguf

    path = tmp_path / "scaled.gguf"
    write_gguf(_hf_model("llama"), path, "F32", "llama")
    writer_path = tmp_path / "with-scaling.gguf"
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(writer_path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())),
                          raw_dtype=t.tensor_type)
    close_gguf(writer)
    with pytest.raises(CheckpointError, match="llama.rope.scaling.type"):
        LLM(str(writer_path), dtype="float32", device="cpu", num_blocks=16)


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
