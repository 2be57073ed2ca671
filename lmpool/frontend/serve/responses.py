"""The OpenAI response objects: whole responses, stream chunks and ``usage``.

Every object carries ``system_fingerprint``: the serving process's id (``server_fingerprint``),
so a client behind a gateway can tell which server answered it (a gateway that passes the
bytes through, as SGLang's ``smg`` does over HTTP, keeps it).

A response holds one ``Choice`` per request the pool ran for it (``n`` of them per prompt, for
each prompt of a list), at the choice's ``index``. A choice may echo its prompt (completions'
``echo``: its text, and its logprobs where asked, before the output's) and may leave its one
token out (``prompt_only``: ``max_tokens`` 0, the prompt alone). ``usage`` counts each prompt
once, however many choices it has.

A stream turns each choice's cumulative outputs into deltas: each chunk carries the text (and,
when asked, the token ids and logprobs) that the choice's previous one did not. Text only ever
grows between two outputs of one stream, since stop strings are held back until they are
ruled out.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from lmpool.frontend.serve.logprobs import TokenText, chat_logprobs, completion_logprobs
from lmpool.outputs import RequestOutput
from lmpool.token_logprobs import TokenLogprobs


def server_fingerprint() -> str:
    """This server process's id: ``lmpool-<pid>``, unique among the servers of one host."""
    return f"lmpool-{os.getpid()}"


@dataclass(frozen=True)
class Choice:
    index: int
    first_of_prompt: bool = True  # the choice that counts its prompt in ``usage``
    echo: str | None = None  # the prompt's text, shown before the output's (completions' echo)
    prompt_only: bool = False  # max_tokens 0: the pool ran one token, which the response leaves out


def usage(pairs: list[tuple[Choice, RequestOutput]]) -> dict:
    firsts = [out for choice, out in pairs if choice.first_of_prompt]
    prompt = sum(len(out.prompt_token_ids) for out in firsts)
    completion = sum(len(out.token_ids) for choice, out in pairs if not choice.prompt_only)
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in firsts)},
    }


@dataclass
class Piece:
    """What a choice shows, whole or as one chunk's delta: text, token ids, and logprob entries
    (with the echoed prompt's first, which ``prompt_ids`` names)."""

    text: str
    token_ids: list[int]
    logprobs: list | None
    prompt_ids: list[int]


class Shape:
    """What one endpoint's objects look like: completions carry ``text``, chat a message.
    ``text`` names tokens in logprobs (None: the request asked for none)."""

    def __init__(self, chat: bool, request_id: str, model: str, return_token_ids: bool,
                 fingerprint: str | None = None, text: TokenText | None = None) -> None:
        self.chat = chat
        self.fingerprint = fingerprint
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.return_token_ids = return_token_ids
        self.text = text

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def full(self, pairs: list[tuple[Choice, RequestOutput]]) -> dict:
        """The whole response of a request that did not stream."""
        choices = [self._choice(choice, whole(choice, out, self.text is not None), finish_reason(choice, out),
                                stream=False) for choice, out in pairs]
        if self.return_token_ids:
            for body, (_, out) in zip(choices, pairs):
                body["prompt_token_ids"] = list(out.prompt_token_ids)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        if self.return_token_ids and sum(c.first_of_prompt for c, _ in pairs) == 1:  # one prompt: at the top too
            body["prompt_token_ids"] = list(pairs[0][1].prompt_token_ids)
        body["usage"] = usage(pairs)
        return body

    def chunk(self, choice: Choice, piece: Piece, finish: str | None, first: bool = False, offset: int = 0) -> dict:
        """One stream chunk of ``choice``; the first of a chat stream also names the role."""
        body = self._choice(choice, piece, finish, stream=True, first=first, offset=offset)
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [body])

    def _choice(self, choice: Choice, piece: Piece, finish: str | None, stream: bool, first: bool = False,
                offset: int = 0) -> dict:
        body: dict = {"index": choice.index, "finish_reason": finish, "logprobs": self._logprobs(piece, offset)}
        if self.chat and stream:
            delta: dict = {"role": "assistant"} if first else {}
            if piece.text:
                delta["content"] = piece.text
            body["delta"] = delta
        elif self.chat:
            body["message"] = {"role": "assistant", "content": piece.text}
        else:
            body["text"] = piece.text
        if self.return_token_ids:
            body["token_ids"] = piece.token_ids
        return body

    def _logprobs(self, piece: Piece, offset: int) -> dict | None:
        if self.text is None or piece.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(self.text, piece.logprobs)
        return completion_logprobs(self.text, piece.prompt_ids + piece.token_ids, piece.logprobs, offset)[0]

    def usage_chunk(self, pairs: list[tuple[Choice, RequestOutput]]) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(pairs)
        return body


def finish_reason(choice: Choice, out: RequestOutput) -> str | None:
    return "length" if choice.prompt_only and out.finish_reason is not None else out.finish_reason


def whole(choice: Choice, out: RequestOutput, logprobs: bool) -> Piece:
    """All a choice shows of ``out``: its echoed prompt first, its output unless ``prompt_only``."""
    text, ids = ("", []) if choice.prompt_only else (out.text or "", list(out.token_ids))
    entries = ([] if choice.prompt_only else list(out.logprobs or ())) if logprobs else None
    if choice.echo is None:
        return Piece(text, ids, entries, [])
    if entries is not None:
        prompt_entries: list[TokenLogprobs | None] = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
        return Piece(choice.echo + text, ids, prompt_entries + entries, list(out.prompt_token_ids))
    return Piece(choice.echo + text, ids, entries, list(out.prompt_token_ids))


class Deltas:
    """Turns one choice's cumulative outputs into the pieces its stream chunks show."""

    def __init__(self, choice: Choice, logprobs: bool) -> None:
        self.choice = choice
        self.logprobs = logprobs
        self.text = ""
        self.tokens = 0
        self.entries = 0
        self.offset = 0  # the logprobs' text offset so far (completions)

    def step(self, out: RequestOutput) -> tuple[Piece, int]:
        """The new piece of ``out`` and the text offset its logprobs start at."""
        piece = whole(self.choice, out, self.logprobs)
        new_text = piece.text[len(self.text):] if piece.text.startswith(self.text) else piece.text
        prompt_ids = piece.prompt_ids if self.tokens == 0 and self.entries == 0 else []
        new = Piece(new_text, piece.token_ids[self.tokens:], None, prompt_ids)
        if piece.logprobs is not None:
            new.logprobs = piece.logprobs[self.entries:]
            self.entries = len(piece.logprobs)
        offset = self.offset
        self.offset += len(new_text)
        self.text, self.tokens = piece.text, len(piece.token_ids)
        return new, offset
