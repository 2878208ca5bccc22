"""Bad input gets a clear nanoserve error naming the bad value and what is allowed — nothing else.
The CLI turns each into one line on stderr and exit status 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve import LLM, CheckpointError, ConfigError, NanoserveError, SamplingParams


@pytest.fixture()
def ckpt(hf_checkpoints, tmp_path):
    """A writable copy of a tiny Llama checkpoint, to break in different ways."""
    dst = tmp_path / "model"
    shutil.copytree(hf_checkpoints["llama-gqa"][0], dst)
    return dst


@pytest.fixture(scope="module")
def llm(hf_checkpoints):
    return LLM(str(hf_checkpoints["gpt2"][0]), dtype="float32", device="cpu")


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_path():
    with pytest.raises(CheckpointError, match=r"'/no/such/model' not found.*shipped model"):
        LLM("/no/such/model")


def test_directory_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError,
                       match="is not a checkpoint: expected a directory with config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(ckpt):
    _edit_config(ckpt, architectures=["BertForMaskedLM"])
    with pytest.raises(
        ConfigError,
        match=r"unsupported architecture 'BertForMaskedLM'; supported: .*LlamaForCausalLM",
    ):
        LLM(str(ckpt))


def test_config_missing_required_field(ckpt):
    _edit_config(ckpt, num_hidden_layers=None)
    with pytest.raises(ConfigError, match="missing the required field 'num_hidden_layers'"):
        LLM(str(ckpt))


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(str(ckpt))


def test_truncated_safetensors(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated or corrupt"):
        LLM(str(ckpt))


def test_corrupt_safetensors_header(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage-header}")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        LLM(str(ckpt))


def test_tensor_with_wrong_shape_is_named(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    key = "model.layers.1.self_attn.k_proj.weight"
    tensors[key] = torch.zeros(7, tensors[key].shape[1])
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError,
                       match=rf"tensor '{key}' has shape \(7, 72\), expected \(24, 72\)"):
        LLM(str(ckpt))


def test_missing_tensor_is_named(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensor 'model.norm.weight'"):
        LLM(str(ckpt))


def test_truncated_llama2c_file(tmp_path, hf_checkpoints):
    from testdata import shared_path

    src = shared_path("models", "stories260K", "stories260K.bin").read_bytes()
    (tmp_path / "m.bin").write_bytes(src[:-100])
    with pytest.raises(CheckpointError, match="header promises 264128 float32 values"):
        LLM(str(tmp_path / "m.bin"))


def test_hub_id_offline_fails_fast_and_clearly():
    start = time.perf_counter()
    with pytest.raises(CheckpointError,
                       match="could not download 'no-such-org/no-such-model'|needs `pip install"):
        LLM("no-such-org/no-such-model")
    assert time.perf_counter() - start < 60


@pytest.mark.parametrize("kwargs,match", [
    ({"dtype": "float8"}, r"unknown dtype 'float8'; supported: .*bfloat16"),
    ({"device": "tpu"}, r"unknown device 'tpu'|unsupported device 'tpu'"),
    ({"device": "banana"}, "unknown device 'banana'; use 'cpu', 'cuda'"),
])
def test_unknown_dtype_or_device(hf_checkpoints, kwargs, match):
    with pytest.raises(NanoserveError, match=match):
        LLM(str(hf_checkpoints["gpt2"][0]), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is absent")
def test_cuda_requested_without_cuda(hf_checkpoints):
    with pytest.raises(NanoserveError, match="CUDA is not available"):
        LLM(str(hf_checkpoints["gpt2"][0]), device="cuda")


def test_empty_prompt(llm):
    with pytest.raises(NanoserveError, match="prompt is empty"):
        llm.generate("")
    with pytest.raises(NanoserveError, match="token id list is empty"):
        llm.generate([[]])


def test_prompt_longer_than_context_gives_both_lengths(llm):
    with pytest.raises(NanoserveError,
                       match="prompt has 300 tokens but the model's context is 256"):
        llm.generate("x" * 300)


def test_token_ids_outside_vocabulary(llm):
    with pytest.raises(NanoserveError,
                       match=r"token id 257 is outside the vocabulary; allowed ids are 0..256"):
        llm.generate([[1, 257]])
    with pytest.raises(NanoserveError, match="token id -1 is outside"):
        llm.logits([-1])


def test_bad_prompt_fails_before_any_generation(llm):
    """Validation happens up front: a bad prompt in a list fails the call before work is spent."""
    with pytest.raises(NanoserveError):
        llm.generate(["fine", ""], SamplingParams(max_tokens=1))


@pytest.mark.parametrize("kwargs,match", [
    ({"max_tokens": 0}, r"max_tokens=0 must be an integer ≥ 1"),
    ({"max_tokens": -5}, r"max_tokens=-5"),
    ({"temperature": -0.1}, r"temperature=-0.1 must be 0 \(greedy\) or a finite number"),
    ({"temperature": float("inf")}, r"temperature=inf must be 0"),
    ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
    ({"top_k": -1}, r"top_k=-1 must be an integer ≥ 0"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(NanoserveError, match=match):
        SamplingParams(**kwargs)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "nanoserve", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args,match", [
    (["generate", "--model", "/no/such/dir", "--prompt", "hi"], "not found"),
    (["generate", "--model", "{gpt2}", "--prompt", ""], "prompt is empty"),
    (["generate", "--model", "{gpt2}", "--prompt", "hi", "--max-tokens", "0"], "max_tokens=0"),
    (["generate", "--model", "{gpt2}", "--prompt", "hi", "--temperature", "-1"],
     "temperature=-1.0"),
    (["generate", "--model", "{gpt2}", "--prompt", "hi", "--top-p", "2"], "top_p=2.0"),
    (["generate", "--model", "{gpt2}", "--prompt", "hi", "--dtype", "int3"],
     "unknown dtype 'int3'"),
    (["eval", "--model", "{gpt2}", "--text", "/no/such/file.txt"], "does not exist"),
])
def test_cli_prints_one_line_and_exits_2(hf_checkpoints, args, match):
    args = [a.replace("{gpt2}", str(hf_checkpoints["gpt2"][0])) for a in args]
    r = _cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanoserve: "
                                                   "error:") and match in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_pytorch_model_bin_file_path_names_its_directory(tmp_path, hf_checkpoints):
    src = hf_checkpoints["gpt2"][0]
    shutil.copytree(src, tmp_path / "m")
    # not a llama2.c file, whatever its suffix
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError,
                       match="is one file of an HF checkpoint; pass its directory"):
        LLM(str(tmp_path / "m" / "pytorch_model.bin"))
