"""Text that reaches the tokenizer from a caller (an HTTP client, through JSON) is refused by
name when it cannot be encoded, rather than failing inside the tokenizer or the chat template
with an error that ``lmpool serve`` can only answer with a 500."""

from __future__ import annotations

import json

import pytest

from lmpool.tokenizer import encode_chat, encode_prompt, load_tokenizer

# What JSON's "\ud800" decodes to: a lone surrogate, which has no UTF-8 form.
LONE_SURROGATE = json.loads('"ab\\ud800c"')


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model)


def test_a_prompt_with_a_lone_surrogate_is_refused_by_name(tokenizer):
    with pytest.raises(ValueError, match="the prompt is not valid Unicode text: surrogates not allowed at character 2"):
        encode_prompt(tokenizer, LONE_SURROGATE)


def test_a_message_with_a_lone_surrogate_is_refused_by_name(tokenizer):
    with pytest.raises(ValueError, match="the conversation is not valid Unicode text"):
        encode_chat(tokenizer, [{"role": "user", "content": LONE_SURROGATE}])


@pytest.mark.parametrize("kwargs", [{"tokenize": True}, {"add_generation_prompt": False},
                                    {"messages": [{"role": "user", "content": "x"}]}, {"tokenizer": None},
                                    {"return_dict": True}, {"continue_final_message": True}])
def test_template_kwargs_cannot_set_what_encode_chat_sets(tokenizer, kwargs):
    with pytest.raises(ValueError, match=f"chat template kwargs cannot set {next(iter(kwargs))}"):
        encode_chat(tokenizer, [{"role": "user", "content": "hi"}], **kwargs)


@pytest.mark.parametrize("template, match", [
    ("{{ raise_exception('no such role') }}", "the chat template failed: no such role"),
    ("{% for %}", "the chat template failed"),
])
def test_a_template_that_fails_is_a_value_error(tokenizer, template, match):
    with pytest.raises(ValueError, match=match):
        encode_chat(tokenizer, [{"role": "user", "content": "hi"}], chat_template=template)
