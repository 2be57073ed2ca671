"""Incremental detokenization: the text of a growing output, decoding a few tokens per step.

Decoding the whole output again for every new token costs O(n) per token, O(n^2) per
request: 1.2 s of CPU for one 4,096-token stream (benchmarks/results/detokenize_NOTES.md),
on the event loop of the application that consumes it. ``Detokenizer`` decodes only a
short window instead: the tokens since the last point where the text was known to end
cleanly (its *prefix*), once without and once with the new tokens; the difference is the
new text. A window whose text ends in U+FFFD (an incomplete UTF-8 sequence) is held until a
later token completes it, so the window is usually one or two tokens long. Special tokens,
which decode to nothing here, never enter it.

Invariants:
- ``text`` only grows by appending: every value a caller saw is a prefix of every later one.
- ``self._prefix <= self._read <= len(self._ids)``; ``text`` is the text of
  ``self._ids[:self._read]`` and tokens past ``_read`` are held, never shown.
- at most ``MAX_HELD`` tokens are held: a window that still ends in U+FFFD after that many
  is shown as it decodes (the output holds invalid bytes or U+FFFD characters of its own;
  no character takes more than four bytes to complete), so a step never decodes more than
  ``MAX_HELD`` + the last shown tokens.
- while no window is shown early, every ``_read`` point ends the text in a complete
  character, so a byte-level tokenizer (Qwen3's) decodes the rest independently of what
  came before: after ``finish()``, ``text`` equals ``tokenizer.decode(ids,
  skip_special_tokens=True)``.
"""

from __future__ import annotations

from collections.abc import Sequence

_INCOMPLETE = "\ufffd"
MAX_HELD = 16


class Detokenizer:
    """The text of one request's output tokens, extended as they arrive."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._given = 0  # token ids given, special ones included
        self._ids: list[int] = []  # the others
        self._prefix = 0  # where the current window starts: a clean end of the text
        self._read = 0  # tokens whose text is in self.text
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _step(self, flush: bool) -> None:
        if self._read == len(self._ids):
            return
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        show = flush or not after.endswith(_INCOMPLETE) or len(self._ids) - self._read > MAX_HELD
        # A text that did not grow (a token with no text of its own) still moves the window on.
        if show and len(after) >= len(before):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)

    @property
    def num_tokens(self) -> int:
        """How many output tokens it has been given."""
        return self._given

    def extend(self, token_ids: Sequence[int]) -> str:
        """Append ``token_ids`` (the output's next tokens); return the text so far."""
        self._given += len(token_ids)
        self._ids.extend(t for t in token_ids if t not in self._special)
        self._step(flush=False)
        return self.text

    def finish(self) -> str:
        """The whole output's text, held tokens included (the output is complete)."""
        self._step(flush=True)
        self._read = len(self._ids)
        return self.text
