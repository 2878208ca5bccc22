"""Tokenizers: text <-> token ids for every model nanoserve runs, one module per file format.

    base.py            the Tokenizer protocol, TokenizerError, checks shared by all
    bpe.py             tiktoken's byte-level BPE (GPT-2, the demo models' byte tokenizer)
    tokenizer_json.py  HF tokenizer.json -> tiktoken ranks
    hf_files.py        tiktoken -> HF tokenizer.json + tokenizer_config.json (for outside tools)
    tiktoken_file.py   tokenizer.tiktoken files
    sentencepiece.py   SentencePiece BPE (Llama-2), with protobuf.py to read tokenizer.model
    llama2c.py         llama2.c tokenizer.bin files
    gguf_vocab.py      the vocabulary a GGUF file carries (tokenizer.ggml.*)
    load.py            load_tokenizer: pick the right one for a checkpoint directory
"""

from .base import RECOGNISED_FILES, Tokenizer, TokenizerError
from .bpe import TiktokenTokenizer, byte_level_tokenizer, gpt2_tokenizer, tiktoken_named
from .hf_files import save_hf_tokenizer
from .llama2c import llama2c_tokenizer
from .load import has_tokenizer, load_tokenizer
from .sentencepiece import SentencePieceTokenizer, sentencepiece_tokenizer
from .tiktoken_file import save_tiktoken, tiktoken_file_tokenizer
from .tokenizer_json import hf_tokenizer

__all__ = ["RECOGNISED_FILES", "SentencePieceTokenizer", "TiktokenTokenizer", "Tokenizer",
           "TokenizerError",
           "byte_level_tokenizer", "gpt2_tokenizer", "has_tokenizer", "hf_tokenizer",
           "llama2c_tokenizer",
           "load_tokenizer", "save_hf_tokenizer", "save_tiktoken", "sentencepiece_tokenizer",
           "tiktoken_file_tokenizer", "tiktoken_named"]
