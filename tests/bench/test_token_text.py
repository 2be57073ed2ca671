"""``benchmarks/peers/token_text.py``: the codec checkpoint's tokenizer turns the text of any token
ids back into exactly those ids, and a shared prefix of ids is a shared prefix of text."""

from __future__ import annotations

import random

from benchmarks.peers.token_text import char_of, codec_checkpoint, text_of

from lmpool.model.config import ModelConfig
from lmpool.tokenizer import encode_prompt, load_tokenizer


def test_codec_text_encodes_back_to_the_ids(tiny_model, tmp_path):
    vocab = ModelConfig.from_pretrained(tiny_model).vocab_size
    tokenizer = load_tokenizer(str(codec_checkpoint(tiny_model, tmp_path / "codec", vocab)))
    rng = random.Random(0)
    ids = list(range(vocab)) + rng.choices(range(vocab), k=2000)
    assert encode_prompt(tokenizer, text_of(ids)) == ids
    assert text_of(ids[:100]) + text_of(ids[100:]) == text_of(ids)


def test_characters_are_distinct_and_never_surrogates():
    chars = [char_of(i) for i in range(151936)]  # Qwen3's vocabulary
    assert len(set(chars)) == len(chars)
    assert not [c for c in chars if 0xD800 <= ord(c) < 0xE000 or ord(c) < 0x100]
