"""Stop strings: a request ends when its output text contains one of ``SamplingParams.stop``.

Tokens do not line up with text, so stop strings are found in the decoded output, where the
tokenizer lives (the user process's output processor, ``lmpool.frontend.output_processor``),
not in the engine: the engine is asked to abort the request once one is seen, as a client
abort would. The final output's text ends
just before the stop string; its token ids include the token that completed it. While a
request streams, text that could be the start of a stop string is held back, so no
partial output shows what the final one cuts.

Invariants:
- ``StopStrings.find`` over the growing texts of one output, up to its first hit, returns
  the index of the first stop string in the latest text, as a search of the whole text
  would; each call searches only the tail a new match could start in.
- ``held_back(text)`` is ``text`` less its longest ending that is a proper prefix of a stop
  string (nothing when there is none).
"""

from __future__ import annotations

# Decoding more tokens can rewrite the end of the text (an incomplete UTF-8 sequence
# shown as U+FFFD becomes its character), so the search restarts a few characters early.
REWRITE_MARGIN = 8


def check_usable(params, tokenizer) -> None:
    """Refuse stop strings for a model without a tokenizer: there is no text to find them in.
    (Params that are not a ``SamplingParams`` are left for request validation to name.)"""
    if getattr(params, "stop", None) and tokenizer is None:
        raise ValueError("stop strings need the model's tokenizer, which this model directory lacks; "
                         "use stop_token_ids instead")


class StopStrings:
    """The stop strings of one request, searched as its output grows."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self._longest = max(map(len, stop))
        self._searched = 0  # characters of the previous text already searched

    def find(self, text: str) -> int | None:
        """Where the first stop string in ``text`` (the output so far) begins, or None."""
        start = max(0, self._searched - self._longest - REWRITE_MARGIN)
        self._searched = len(text)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def held_back(self, text: str) -> str:
        """``text`` less any ending that a stop string starts with (it may be completed next)."""
        for k in range(min(len(text), self._longest - 1), 0, -1):
            if any(len(s) > k and s.startswith(text[-k:]) for s in self.stop):
                return text[:-k]
        return text
