"""Stop strings (``lmpool.stop_strings``): found in growing text as a whole-text search
finds them, held back while they may still be completing, and refused without a tokenizer;
``LLM`` ends a request at the first one and returns the text before it."""

from __future__ import annotations

import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmpool import LLM, SamplingParams
from lmpool.stop_strings import StopStrings, check_usable

ALPHABET = "ab\n\ufffd"


@given(text=st.text(ALPHABET, max_size=40), stop=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1,
                                                          max_size=3), cuts=st.lists(st.integers(0, 40), max_size=8))
def test_growing_text_finds_the_first_stop_as_a_whole_search_would(text, stop, cuts):
    stops = StopStrings(tuple(stop))
    for end in [*sorted(cuts), len(text)]:  # until the first hit, as a request ends there
        seen = text[:end]
        whole = [i for i in (seen.find(s) for s in stop) if i >= 0]
        found = stops.find(seen)
        assert found == (min(whole) if whole else None)
        if found is not None:
            break


@given(text=st.text(ALPHABET, max_size=30), stop=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1,
                                                          max_size=3))
def test_held_back_text_drops_exactly_the_longest_ending_a_stop_string_starts_with(text, stop):
    kept = StopStrings(tuple(stop)).held_back(text)
    assert text.startswith(kept)
    tail = text[len(kept):]
    assert tail == "" or any(s.startswith(tail) and s != tail for s in stop)
    longer = [k for k in range(len(tail) + 1, len(text) + 1) if any(s.startswith(text[-k:]) and s != text[-k:]
                                                                     for s in stop)]
    assert not longer


def test_a_rewritten_ending_is_searched_again():
    """Three bytes of a four-byte character decode as three U+FFFD; the next token turns them
    into one character, so the new text is shorter and its stop string starts earlier than
    the previous text's end less the stop's length."""
    stops = StopStrings(("\U0001F600!",))
    assert stops.find("x" * 10 + "\ufffd" * 3) is None
    assert stops.find("x" * 10 + "\U0001F600!") == 10


def test_stop_strings_need_a_tokenizer_and_are_non_empty_strings():
    check_usable(SamplingParams(), None)
    check_usable(SamplingParams(stop="x"), object())
    with pytest.raises(ValueError, match="need the model's tokenizer"):
        check_usable(SamplingParams(stop="x"), None)
    assert SamplingParams(stop="x").stop == ("x",)
    for bad in ("", [""], [3]):
        with pytest.raises(ValueError, match="stop must be non-empty strings"):
            SamplingParams(stop=bad)


def stop_inside(text: str) -> str:
    """A stop string from the middle of ``text`` that does not occur earlier."""
    for start in range(2, len(text) - 2):
        candidate = text[start:start + 3]
        if candidate.strip() and text.find(candidate) == start:
            return candidate
    raise AssertionError(f"no usable stop string in {text!r}")


def test_llm_ends_a_request_at_its_first_stop_string(tiny_model):
    prompt = "The harbour town woke slowly"
    free = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(tiny_model, block_size=16) as llm:
        full = llm.generate(prompt, free)[0]
        stop = stop_inside(full.text)
        cut = full.text.index(stop)
        out, other = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                                                   stop=(stop, "never-seen")), free])
        assert out.finish_reason == "stop" and out.text == full.text[:cut]
        assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
        assert stop in llm.decode(out.token_ids), "the tokens include the one that completed the stop string"
        assert other.token_ids == full.token_ids, "a request without stop strings beside it runs to its end"
        assert llm.engine.requests == {}, "the stopped request left nothing behind"


def test_llm_without_a_tokenizer_refuses_stop_strings(tiny_model, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model, bare)
    for f in bare.glob("tokenizer*"):
        f.unlink()
    with LLM(str(bare), block_size=16) as llm:
        assert llm.tokenizer is None
        with pytest.raises(ValueError, match="prompt 0: stop strings need the model's tokenizer"):
            llm.generate([[1, 2, 3]], SamplingParams(stop="x"))
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].text is None
