"""Incremental detokenization (``lmpool.detokenizer``): the text only grows, ends equal to a
whole decode of the output, shows every clean prefix of a text as it arrives, and decodes
a short window per step however long the output is."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lmpool.detokenizer import MAX_HELD, Detokenizer
from lmpool.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model)


class CountingTokenizer:
    """The tokenizer, recording how many ids each decode call was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.windows = tokenizer, []

    def decode(self, ids, **kwargs) -> str:
        self.windows.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def chunks(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = [0, *sorted(c % (len(ids) + 1) for c in cuts), len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_token_ids_end_as_their_whole_decode_and_the_text_only_grows(tokenizer, data):
    """Arbitrary ids: lone bytes of multi-byte characters, special tokens, in any chunks."""
    # At most MAX_HELD ids, so no window is shown early: then the text is exactly the decode.
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=MAX_HELD))
    cuts = data.draw(st.lists(st.integers(0, MAX_HELD), max_size=10))
    detok, shown = Detokenizer(tokenizer), []
    for part in chunks(ids, cuts):
        shown.append(detok.extend(part))
    shown.append(detok.finish())
    for before, after in zip(shown, shown[1:]):
        assert after.startswith(before)
    assert shown[-1] == tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_an_encoded_text_shows_as_its_own_prefixes_one_short_window_at_a_time(tokenizer, text):
    # A special token's text encodes to that token, which the output never shows.
    assume(not any(special in text for special in tokenizer.get_added_vocab()))
    ids = tokenizer.encode(text, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detok = Detokenizer(counting)
    for token in ids:
        assert text.startswith(detok.extend([token]))
    # Before finishing, everything but an incomplete last character is shown.
    assert len(detok.text) >= len(text) - 1
    assert detok.finish() == text
    # A window holds the last shown token(s) and those of one unfinished character: at most
    # 4 + 4 byte tokens, never the whole output.
    assert max(counting.windows, default=0) <= 8


def test_a_long_output_is_decoded_in_windows_of_a_few_tokens(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 200, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detok = Detokenizer(counting)
    for token in ids:
        detok.extend([token])
    assert detok.finish() == tokenizer.decode(ids)
    assert len(ids) > 1000 and max(counting.windows) <= 2
    assert sum(counting.windows) <= 4 * len(ids)


def test_finish_shows_held_incomplete_bytes_and_trailing_special_tokens(tokenizer):
    euro = tokenizer.encode("€", add_special_tokens=False)
    lone = tokenizer.encode("a€", add_special_tokens=False)[:-1]  # "a" and a partial character, if split
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    detok = Detokenizer(tokenizer)
    detok.extend(lone + [end])
    assert detok.finish() == tokenizer.decode(lone + [end], skip_special_tokens=True)
    assert Detokenizer(tokenizer).finish() == ""
    whole = Detokenizer(tokenizer)
    whole.extend(euro)
    assert whole.text == "€"


def test_special_tokens_never_widen_the_window(tokenizer):
    """A model that keeps emitting EOS (``ignore_eos``) or other special tokens: each step still
    decodes a window of a few tokens, not everything since the last visible text."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("hello world", add_special_tokens=False) + [end] * 500
    counting = CountingTokenizer(tokenizer)
    detok = Detokenizer(counting)
    for token in ids:
        detok.extend([token])
    assert detok.num_tokens == len(ids)
    assert detok.finish() == tokenizer.decode(ids, skip_special_tokens=True) == "hello world"
    assert max(counting.windows) <= 4


def test_a_run_of_invalid_bytes_is_shown_after_at_most_max_held_tokens(tokenizer):
    """Lone UTF-8 continuation bytes decode to U+FFFD for good: the text shows them while the
    output streams, each step's window stays bounded, and the end is the whole decode."""
    lone = tokenizer.encode("€", add_special_tokens=False)[-1]  # a continuation byte by itself
    ids = tokenizer.encode("ok ", add_special_tokens=False) + [lone] * 200
    counting = CountingTokenizer(tokenizer)
    detok = Detokenizer(counting)
    shown = [detok.extend([token]) for token in ids]
    assert shown[-1].startswith("ok \ufffd")  # shown before the output ends
    assert max(counting.windows) <= 2 * MAX_HELD + 2
    assert detok.finish() == tokenizer.decode(ids, skip_special_tokens=True)
