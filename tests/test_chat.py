"""Chat templates: rendering agrees with transformers' own renderer, special tokens become their
ids, templates are found where HF checkpoints keep them, and bad messages are refused clearly."""

from __future__ import annotations

import json

import pytest

from nanoserve.errors import NanoserveError
from nanoserve.serving.chat import ChatTemplate, encode_with_special_tokens, load_chat_template
from nanoserve.tokenizers import byte_level_tokenizer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama-2 style: BOS from the variable, roles checked with raise_exception, whitespace control
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set sys = '<<SYS>>\\n' + "
          "messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}{% set messages = messages[1:] %}{% "
          "else %}{% set sys = '' %}{% endif %}{% for message in messages %}\n  {% if "
          "(message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
          "raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') "
          "}}{% endif %}\n  {% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + (sys if "
          "loop.first else '') + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + "
          "message['content'] + ' ' + eos_token }}{% endif %}\n{% endfor %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Ünïcode — ok?"}]


@pytest.mark.parametrize("source", [CHATML, LLAMA2], ids=["chatml", "llama2"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_equals_transformers(source, add_generation_prompt):
    from transformers.utils.chat_template_utils import render_jinja_template

    want = render_jinja_template([MESSAGES], chat_template=source,
                                 add_generation_prompt=add_generation_prompt,
                                 bos_token="<s>", eos_token="</s>")
    want = want[0][0] if isinstance(want, tuple) else want[0]
    got = ChatTemplate(source, "<s>", "</s>").render(MESSAGES, add_generation_prompt)
    assert got == want


def test_template_errors_are_nanoserve_errors():
    bad_order = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(NanoserveError, match="roles must alternate"):
        ChatTemplate(LLAMA2, "<s>", "</s>").render(bad_order)
    with pytest.raises(NanoserveError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
    for messages in ([], [{"role": "wizard", "content": "x"}], [{"role": "user"}], "hi"):
        with pytest.raises(NanoserveError, match="messages"):
            ChatTemplate(CHATML).render(messages)


def test_special_tokens_become_single_ids_and_the_rest_is_ordinary_text():
    tok = byte_level_tokenizer()  # 256 bytes + <|endoftext|> = 256
    text = "<|endoftext|>user: hi<|endoftext|><|endof"
    ids = encode_with_special_tokens(text, tok)
    assert ids == [256, *tok.encode("user: hi"), 256, *tok.encode("<|endof")]
    # plain encode never makes the special id (the negative control)
    assert tok.encode(text).count(256) == 0


def test_templates_are_found_where_hf_keeps_them(tmp_path):
    tok = byte_level_tokenizer()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"},
                           {"name": "default", "template": CHATML}],
         "eos_token": {"content": "<|endoftext|>"}}))
    t = load_chat_template(tmp_path / "a", tok)
    assert t.source == CHATML and t.eos_token == "<|endoftext|>" and t.bos_token is None
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "chat_template.jinja").write_text(CHATML)
    assert load_chat_template(tmp_path / "b").source == CHATML
    assert load_chat_template("demo") is None  # the shipped model was never taught a chat format
