"""Output processing: what a request's caller sees, built from the token ids the engine reports.

``LLM`` and the pool's API feed one ``RequestState`` per request its new token ids as they
arrive; it detokenises them, ends the request at a stop string (``lmpool.stop_strings``)
and assembles each ``RequestOutput``: the cumulative one a stream shows, and the final one.

Invariants:
- an output is final exactly when its ``finish_reason`` is set; after a stop string it is
  "stop" and the text ends just before the stop string. A final output the engine gave no
  finish reason for is one its caller still has to abort in the engine.
- text is decoded incrementally where it is needed before the end (streamed, or searched for
  stop strings), else once at the end; without a tokenizer it is None.
- a streamed output's text never shows what a later one cuts: a possible start of a stop
  string is held back until the request goes on past it or ends.
- every output holds its own ``token_ids`` list.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmpool.detokenizer import Detokenizer
from lmpool.outputs import RequestOutput
from lmpool.sampling_params import SamplingParams
from lmpool.stop_strings import StopStrings
from lmpool.token_logprobs import TokenLogprobs


class OutputProcessor:
    """One frontend's output side: its tokenizer, and a state for each request it serves."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer  # None where the model directory has none

    def new_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, stream: bool = False,
    ) -> RequestState:
        """The output state of a request about to run; ``stream`` when every output is shown."""
        return RequestState(self, request_id, prompt_token_ids, params, stream)

    def decode(self, token_ids: Sequence[int]) -> str | None:
        """The text of ``token_ids``, decoded at once (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


class RequestState:
    """One request's output, grown from its token ids. The caller keeps ``num_cached_tokens``,
    ``rank``, ``route``, ``predicted_ttft_s``, ``dispatch_s``, ``intake_s``, ``queued_s`` and
    ``first_step_s`` current (a pool may move a request to another rank)."""

    def __init__(
        self, processor: OutputProcessor, request_id: str, prompt_token_ids: Sequence[int],
        params: SamplingParams, stream: bool,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.rank: int | None = None
        self.route: str | None = None
        self.predicted_ttft_s: float | None = None
        self.dispatch_s: float | None = None
        self.queued_s: float | None = None
        self.first_step_s: float | None = None
        self.intake_s: float | None = None
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self._processor = processor
        self._stream = stream
        self._stops = StopStrings(params.stop) if params.stop else None
        # Decoding step by step costs a little per token: only where the text is read before the end.
        step_by_step = processor.tokenizer is not None and (stream or self._stops is not None)
        self._detok = Detokenizer(processor.tokenizer) if step_by_step else None

    def update(self, new_token_ids: Sequence[int], finish_reason: str | None = None,
               logprobs: Sequence[TokenLogprobs] = (),
               prompt_logprobs: list[TokenLogprobs | None] | None = None) -> RequestOutput | None:
        """Take the request's next token ids (and their logprobs, and the prompt's, where it asked
        for them), with the engine's finish reason once it has one. Returns the output a stream
        shows now, or the final one; None while a request that is not streamed goes on."""
        self.token_ids.extend(new_token_ids)
        if self.logprobs is not None:
            self.logprobs.extend(logprobs)
        if prompt_logprobs is not None and self.prompt_logprobs is None:  # a recomputation sends them again
            self.prompt_logprobs = prompt_logprobs
        text = self._text(new_token_ids, final=finish_reason is not None)
        if self._stops is not None:
            assert text is not None  # stop strings need a tokenizer: the text is decoded step by step
            hit = self._stops.find(text)
            if hit is not None:  # the text shows a stop string: the request ends just before it
                text, finish_reason = text[:hit], "stop"
        self.finish_reason = finish_reason
        if finish_reason is None:
            if not self._stream:
                return None
            text = self._held_back(text)
        return self._output(text)

    def abort(self) -> RequestOutput:
        """The final output of a request stopped before its end: all its tokens' text, no stop search."""
        self.finish_reason = "abort"
        return self._output(self._text((), final=True))

    def _text(self, new_token_ids: Sequence[int], final: bool) -> str | None:
        """The text so far; None before the end where nothing reads it sooner."""
        if self._detok is None:
            return self._processor.decode(self.token_ids) if final else None
        self._detok.extend(new_token_ids)
        return self._detok.finish() if final else self._detok.text

    def _held_back(self, text: str | None) -> str | None:
        """``text`` as a stream may show it: less any ending a stop string may go on from."""
        if self._stops is None:
            return text
        assert text is not None  # stop strings need a tokenizer: the text is decoded step by step
        return self._stops.held_back(text)

    def _output(self, text: str | None) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.token_ids),
            text=text,
            num_cached_tokens=self.num_cached_tokens,
            finish_reason=self.finish_reason,
            rank=self.rank,
            route=self.route,
            predicted_ttft_s=self.predicted_ttft_s,
            dispatch_s=self.dispatch_s,
            queued_s=self.queued_s,
            first_step_s=self.first_step_s,
            intake_s=self.intake_s,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            prompt_logprobs=self.prompt_logprobs,
        )
