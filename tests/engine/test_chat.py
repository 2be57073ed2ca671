"""Chat: a conversation rendered by the tokenizer's chat template (the generated models carry
Qwen3's ChatML form), generated as the rendered prompt would be; every malformed input is
refused naming the conversation and the message."""

from __future__ import annotations

import shutil
import json

import pytest

from lmpool import LLM, SamplingParams
from lmpool.tokenizer import encode_chat

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TALK = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a harbour town."}]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, block_size=16) as engine:
        yield engine


def test_a_conversation_renders_as_chatml_with_the_assistant_turn_open(llm):
    ids = encode_chat(llm.tokenizer, TALK)
    assert llm.tokenizer.decode(ids) == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                                         "<|im_start|>user\nName a harbour town.<|im_end|>\n<|im_start|>assistant\n")
    assert llm.tokenizer.convert_tokens_to_ids("<|im_start|>") in ids, "the markers are the special tokens"


def test_chat_generates_what_the_rendered_prompt_generates(llm):
    rendered = encode_chat(llm.tokenizer, TALK)
    one = llm.chat(TALK, GREEDY)
    two = llm.chat([TALK, TALK[1:]], GREEDY)
    assert len(one) == 1 and one[0].prompt_token_ids == rendered
    assert one[0].token_ids == llm.generate(rendered, GREEDY)[0].token_ids == two[0].token_ids
    assert two[1].prompt_token_ids == encode_chat(llm.tokenizer, TALK[1:])


@pytest.mark.parametrize("conversations, match", [
    ([], "a conversation .* or a non-empty list"),
    ([TALK, []], "conversation 1: a conversation is a non-empty list of message dicts"),
    ([{"role": "user"}], "conversation 0: message 0 needs a 'role' and a 'content' string"),
    ([[{"role": "user", "content": 3}]], "conversation 0: message 0 needs"),
])
def test_malformed_conversations_are_refused_and_the_engine_keeps_serving(llm, conversations, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(conversations, GREEDY)
    assert llm.engine.requests == {}
    assert llm.chat(TALK, GREEDY)[0].finish_reason == "length"


def test_a_model_without_a_chat_template_or_tokenizer_says_so(tiny_model, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(tiny_model, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    with LLM(str(plain), block_size=16) as llm:
        with pytest.raises(ValueError, match="conversation 0: this model's tokenizer has no chat template"):
            llm.chat(TALK)
    for f in plain.glob("tokenizer*"):
        f.unlink()
    with LLM(str(plain), block_size=16) as llm:
        with pytest.raises(ValueError, match="has no tokenizer, so it has no chat template"):
            llm.chat(TALK)
