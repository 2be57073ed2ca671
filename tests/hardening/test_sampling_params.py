"""SamplingParams refuse, by name, every value of the wrong type or one the device would
round to nothing; and whatever they accept decodes unchanged in every process of a pool
(a worker decodes what the API accepted: a value the API took but the worker could not
decode used to kill the rank)."""

from __future__ import annotations

import math
from array import array

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmpool.errors import ArgumentTypeError
from lmpool.protocol import AddRequest, FrontendToWorker
from lmpool.protocol.frontend_worker import pack_ids
from lmpool.sampling_params import SamplingParams


@pytest.mark.parametrize("value", [1, 0, "yes", None, np.bool_(True), 1.0])
def test_ignore_eos_takes_only_a_bool(value):
    with pytest.raises(TypeError, match="ignore_eos must be True or False"):
        SamplingParams(ignore_eos=value)


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [True, np.bool_(False), "3", 3.0, None, [3]])
def test_integer_fields_take_no_bools_strings_or_floats(field, value):
    if field in ("seed", "logprobs", "prompt_logprobs") and value is None:
        return  # None: unseeded, no logprobs
    with pytest.raises(TypeError, match=f"{field} must be an integer"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [True, "0.5", None, b"1", [0.5]])
def test_float_fields_take_only_numbers(field, value):
    with pytest.raises(TypeError, match=f"{field} must be a number"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": 1e-38}, "temperature 1e-38 is below 0.01.*temperature=0"),
    ({"temperature": 5e-324}, "is below 0.01"),
    ({"top_p": 1e-300}, "top_p 1e-300 is below 1.18e-38: it would round to 0"),
    ({"top_p": math.nan}, "top_p must be a finite number"),
    ({"temperature": math.nan}, "temperature must be a finite number"),
])
def test_values_that_underflow_on_the_device_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"stop": b"x"}, {"stop": {"a": 1}}, {"stop_token_ids": {1: 2}},
                                    {"stop_token_ids": 5}, {"cache_salt": 5}, {"cache_salt": b"s"}])
def test_containers_of_the_wrong_kind_are_refused(kwargs):
    with pytest.raises(ArgumentTypeError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"top_k": 2**70}, "top_k must fit in a signed 64-bit integer"),
    ({"top_k": -(2**64)}, "top_k must fit in a signed 64-bit integer"),
    ({"max_tokens": 2**64}, "max_tokens must fit in a signed 64-bit integer"),
    ({"stop_token_ids": [3, 2**70]}, "a stop token id must fit in a signed 64-bit integer"),
])
def test_integers_too_large_for_the_wire_are_refused_by_name(kwargs, match):
    """They used to be accepted, then fail to encode for the workers with an OverflowError
    (a 500 from ``lmpool serve``)."""
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_wrong_type_is_both_a_type_error_and_the_documented_value_error():
    with pytest.raises(ValueError):
        SamplingParams(ignore_eos=1)
    assert issubclass(ArgumentTypeError, TypeError)


def test_numpy_numbers_are_taken_as_python_numbers():
    p = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), max_tokens=np.int64(7),
                       stop_token_ids=np.array([3, 4]))
    assert type(p.temperature) is float and type(p.max_tokens) is int and p.stop_token_ids == (3, 4)


ANYTHING = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=4),
    st.binary(max_size=4), st.lists(st.integers(-3, 3), max_size=3), st.just(np.bool_(True)),
    st.just(np.int32(3)), st.just(np.float32(0.25)), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)
FIELDS = ["temperature", "top_p", "top_k", "max_tokens", "ignore_eos", "stop_token_ids", "seed", "stop", "cache_salt",
          "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty"]
_wire = msgspec.msgpack.Decoder(FrontendToWorker)
_encode = msgspec.msgpack.Encoder().encode


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), ANYTHING, max_size=4))
def test_whatever_is_accepted_decodes_unchanged_on_a_worker(kwargs):
    """Arbitrary values in arbitrary fields: either a TypeError/ValueError at once, or
    params that a worker decodes from an ``AddRequest`` as exactly the same."""
    try:
        params = SamplingParams(**kwargs)
    except (TypeError, ValueError):
        return
    msg = AddRequest("r", pack_ids(array("q", [1, 2, 3])), params, [], [])
    assert _wire.decode(_encode(msg)) == msg
