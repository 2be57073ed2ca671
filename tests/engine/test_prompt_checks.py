"""The prompt's checks and block hashes take a fast path for plain token ids: it must accept
and refuse exactly what the element-by-element rules do, and hash exactly as one block at a time.
A worker's admission of a request the frontend checked refuses every id those rules refuse."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmpool.engine.hashing import ROOT_HASH, block_hash, chain_hashes
from lmpool.engine.validation import check_admissible, check_prompt
from lmpool.protocol.frontend_worker import pack_ids, unpack_ids
from lmpool.sampling_params import SamplingParams
from lmpool.tokenizer import encode_prompt

VOCAB = 1000


def element_by_element(prompt) -> str | None:
    """What the rules refuse, one token at a time: the first offence's kind, or None."""
    if not prompt:
        return "empty"
    for t in prompt:
        if not isinstance(t, int) or isinstance(t, bool):
            return "not an integer token id"
        if not 0 <= t < VOCAB:
            return "outside the vocabulary"
    return None


tokens = st.one_of(
    st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1),  # mostly valid
    st.integers(-(2**70), 2**70), st.booleans(), st.floats(allow_nan=False), st.just(None),
)


@given(st.lists(tokens, max_size=40))
def test_check_prompt_refuses_exactly_what_the_rules_refuse(prompt):
    expected = element_by_element(prompt)
    if expected is None:
        ids = check_prompt(prompt, VOCAB)  # the ids, as the int64 array the block hashes read
        assert ids.typecode == "q" and ids.tolist() == prompt
    else:
        with pytest.raises(ValueError, match=expected):
            check_prompt(prompt, VOCAB)


def test_encode_prompt_turns_numpy_integers_into_python_ones_and_leaves_the_rest_to_validation():
    assert encode_prompt(None, [1, np.int64(2), 3]) == [1, 2, 3]
    assert all(type(t) is int for t in encode_prompt(None, np.array([4, 5], dtype=np.int32)))
    mixed = encode_prompt(None, (1, True, 2.5))
    assert mixed == [1, True, 2.5] and type(mixed[1]) is bool  # still refused by check_prompt
    ids = [7, 8, 9]
    assert encode_prompt(None, ids) == ids and encode_prompt(None, ids) is not ids  # the caller's list is not shared


@given(st.lists(tokens, max_size=40))
def test_encode_prompt_s_fast_path_keeps_every_item_and_its_type(prompt):
    """Plain ints take msgspec's strict conversion; a list with anything else (a bool, a float,
    None, an int past 64 bits) comes back item for item, type for type, for validation to name."""
    encoded = encode_prompt(None, prompt)
    assert encoded == prompt and encoded is not prompt
    assert [type(t) for t in encoded] == [type(t) for t in prompt]


@given(st.lists(st.integers(0, 2**40), max_size=70), st.sampled_from([1, 4, 16]), st.integers(0, 5),
       st.one_of(st.none(), st.text(max_size=5)))
def test_chain_hashes_equal_hashing_one_block_at_a_time(ids, block_size, known, salt):
    expected, parent = [], ROOT_HASH
    for i in range(len(ids) // block_size):
        parent = block_hash(parent, ids[i * block_size : (i + 1) * block_size], salt)
        expected.append(parent)
    assert chain_hashes(ids, block_size, salt=salt) == expected
    start = expected[:known]
    assert chain_hashes(ids, block_size, start, salt) == expected
    # From check_prompt's int64 array, read without another conversion: the same hashes.
    converted = array("q", ids)
    assert chain_hashes(converted, block_size, salt=salt) == expected
    assert chain_hashes(converted, block_size, start, salt) == expected


class Unread(list):
    """A prompt whose items must not be read."""

    def __iter__(self):
        raise AssertionError("the prompt's items were read")


def test_a_prompt_past_the_context_is_refused_for_its_length_before_its_items_are_read():
    from lmpool.engine.validation import validate_request
    from lmpool.sampling_params import SamplingParams

    prompt = Unread([0] * 5000)
    with pytest.raises(ValueError, match="exceeds max_model_len 4096"):
        validate_request(prompt, SamplingParams(max_tokens=16), vocab_size=VOCAB, max_model_len=4096, block_size=16,
                         max_blocks=10_000)


PARAMS = SamplingParams(max_tokens=4)


def int32s(ids: list[int]) -> np.ndarray:
    """``ids`` as a worker reads a prompt off its message (``unpack_ids``)."""
    return unpack_ids(np.array(ids, dtype=np.int32).tobytes())


@given(st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(0, VOCAB - 1), min_size=1, max_size=40),
       st.integers(0, 4), st.integers(-(2**64) + 1, 2**64 - 1) | st.integers(0, VOCAB - 1))
def test_a_worker_s_admission_refuses_what_the_frontend_would_and_hashes_nothing(ids, outputs, output):
    """``check_admissible`` (a worker's, for a typed message the frontend checked) refuses every
    id the frontend's rules refuse, in its packed prompt or in the outputs it resumes with, accepts
    every request they accept, and counts the hashes."""
    cut = max(1, len(ids) - outputs)
    prompt, resumed = int32s(ids[:cut]), ids[cut:] + [output]
    hashes = [bytes(32)] * ((len(ids) + 1) // 4)
    kw = {"vocab_size": VOCAB, "max_model_len": 1000, "block_size": 4, "max_blocks": 1000}
    if element_by_element(ids + [output]) is None:
        check_admissible(prompt, resumed, PARAMS, hashes, **kw)
        with pytest.raises(ValueError, match="block hashes for"):
            check_admissible(prompt, resumed, PARAMS, hashes + [bytes(32)], **kw)
    else:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            check_admissible(prompt, resumed, PARAMS, hashes, **kw)


@given(st.lists(st.integers(0, 2**63 - 1) | st.integers(0, VOCAB - 1), min_size=0, max_size=40))
def test_a_prompt_travels_as_int32s_and_nothing_else_passes(ids):
    """``pack_ids`` gives the worker back every id of [0, 2**31) unchanged and refuses any other;
    ``unpack_ids`` refuses bytes that are not whole int32s."""
    if all(t < 2**31 for t in ids):
        assert unpack_ids(pack_ids(array("q", ids))).tolist() == ids
    else:
        with pytest.raises(ValueError, match="no int32 form"):
            pack_ids(array("q", ids))
    with pytest.raises(ValueError, match="not whole int32"):
        unpack_ids(bytes(4 * len(ids) + 3))


def test_a_resumed_request_counts_its_prompt_and_max_tokens_against_the_context_not_its_outputs_twice():
    """A request moved after a failure carries its outputs; ``max_tokens`` already covers them."""
    kw = {"vocab_size": VOCAB, "max_model_len": 12, "block_size": 4, "max_blocks": 1000}
    check_admissible(int32s([1] * 8), [2] * 3, PARAMS, [bytes(32)] * 2, **kw)  # 8 + 4 <= 12
    with pytest.raises(ValueError, match="exceeds max_model_len 12"):
        check_admissible(int32s([1] * 9), [], PARAMS, [bytes(32)] * 2, **kw)
    with pytest.raises(ValueError, match="needs 3 KV blocks; this rank holds 2"):
        check_admissible(int32s([1] * 8), [], PARAMS, [bytes(32)] * 2, **kw | {"max_blocks": 2})
