"""The output processor (``lmpool.frontend.output_processor``): a streamed request shows only
prefixes of its final text, which ends before its first stop string; a request not streamed
shows only its final output; an abort keeps all the text; outputs never share token lists."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lmpool.frontend.output_processor import OutputProcessor
from lmpool.sampling_params import SamplingParams

ALPHABET = "ab\n"


class CharTokenizer:
    """One character per token id; id 0 is a special token with no text."""

    all_special_ids = (0,)

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(i) for i in ids if i != 0)


def ids_of(text: str) -> list[int]:
    return [ord(c) for c in text]


def run(state, ids: list[int], finish_reason: str = "length") -> list:
    """Every output ``state`` gives while fed ``ids`` one at a time, the last with ``finish_reason``,
    up to the final one (a stop string may end the request sooner)."""
    outputs = []
    for i, token in enumerate(ids):
        out = state.update([token], finish_reason if i == len(ids) - 1 else None)
        if out is not None:
            outputs.append(out)
            if out.finish_reason is not None:
                break
    return outputs


@given(text=st.text(ALPHABET, min_size=1, max_size=30),
       stop=st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3))
def test_a_stream_shows_prefixes_of_its_final_text_which_ends_before_the_first_stop(text, stop):
    params = SamplingParams(max_tokens=64, stop=tuple(stop))
    state = OutputProcessor(CharTokenizer()).new_request("r", [1, 2], params, stream=True)
    outputs = run(state, ids_of(text))
    final = outputs[-1]
    if any(s in text for s in stop):
        shown = text[:min(text.find(s) + len(s) for s in stop if s in text)]  # up to the first stop's last token
        assert final.finish_reason == "stop" and final.text == shown[:min(shown.find(s) for s in stop if s in shown)]
        assert final.token_ids == ids_of(shown)
    else:
        assert final.finish_reason == "length" and final.text == text and final.token_ids == ids_of(text)
    for out in outputs:
        assert final.text.startswith(out.text), "no partial output shows what the final one cuts"
        assert out.prompt_token_ids == [1, 2]
    assert all(out.finish_reason is None for out in outputs[:-1])
    assert [len(out.token_ids) for out in outputs] == list(range(1, len(outputs) + 1))


def test_a_request_not_streamed_shows_only_its_final_output():
    processor = OutputProcessor(CharTokenizer())
    plain = processor.new_request("a", [1], SamplingParams())
    assert [plain.update([t]) for t in ids_of("hel")] == [None, None, None]
    final = plain.update([0, *ids_of("lo")], "stop")
    assert (final.text, final.finish_reason, final.token_ids) == ("hello", "stop", [*ids_of("hel"), 0, *ids_of("lo")])
    stopped = processor.new_request("b", [1], SamplingParams(stop="ll"))
    assert [stopped.update([t]) for t in ids_of("hel")] == [None, None, None]
    out = stopped.update(ids_of("l"))  # the engine goes on: the caller aborts it there
    assert (out.text, out.finish_reason, out.token_ids) == ("he", "stop", ids_of("hell"))


def test_without_a_tokenizer_there_is_no_text():
    state = OutputProcessor(None).new_request("r", [1], SamplingParams(), stream=True)
    assert [out.text for out in run(state, [5, 6, 7])] == [None, None, None]


def test_an_abort_ends_with_all_the_text_its_tokens_hold():
    state = OutputProcessor(CharTokenizer()).new_request("r", [1], SamplingParams(stop="bc"), stream=True)
    assert state.update(ids_of("ab")).text == "a", "a possible stop string is held back"
    state.rank, state.route, state.num_cached_tokens = 1, "pinned", 16
    out = state.abort()
    assert (out.text, out.finish_reason, out.token_ids) == ("ab", "abort", ids_of("ab"))
    assert (out.rank, out.route, out.num_cached_tokens) == (1, "pinned", 16)


def test_outputs_never_share_token_lists():
    state = OutputProcessor(CharTokenizer()).new_request("r", [1], SamplingParams(), stream=True)
    first = state.update(ids_of("a"))
    second = state.update(ids_of("b"), "length")
    assert first.token_ids == ids_of("a") and second.token_ids == ids_of("ab")
