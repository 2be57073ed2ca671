"""The OpenAI response objects: whole responses, stream chunks and ``usage``.

Every object carries ``system_fingerprint``: the serving process's id (``server_fingerprint``),
so a client behind a gateway can tell which server answered it (a gateway that passes the
bytes through, as SGLang's ``smg`` does over HTTP, keeps it).

A stream turns the pool's cumulative outputs into deltas: each chunk carries the text (and,
when asked, the token ids) that the previous one did not. Text only ever grows between two
outputs of one stream, since stop strings are held back until they are ruled out.
"""

from __future__ import annotations

import os
import time

from lmpool.outputs import RequestOutput


def server_fingerprint() -> str:
    """This server process's id: ``lmpool-<pid>``, unique among the servers of one host."""
    return f"lmpool-{os.getpid()}"


def usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


class Shape:
    """What one endpoint's objects look like: completions carry ``text``, chat a message."""

    def __init__(self, chat: bool, request_id: str, model: str, return_token_ids: bool,
                 fingerprint: str | None = None) -> None:
        self.chat = chat
        self.fingerprint = fingerprint
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.return_token_ids = return_token_ids

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def full(self, out: RequestOutput) -> dict:
        """The whole response of a request that did not stream."""
        choice: dict = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        if self.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        if self.return_token_ids:
            body["prompt_token_ids"] = list(out.prompt_token_ids)
        body["usage"] = usage(out)
        return body

    def chunk(self, text: str | None, token_ids: list[int], finish_reason: str | None,
              first: bool = False) -> dict:
        """One stream chunk; the first of a chat stream also names the role."""
        choice: dict = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            delta: dict = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, out: RequestOutput) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(out)
        return body


class Deltas:
    """Turns a stream's cumulative outputs into (new text, new token ids)."""

    def __init__(self) -> None:
        self.text = ""
        self.tokens = 0

    def step(self, out: RequestOutput) -> tuple[str, list[int]]:
        text = out.text or ""
        new_text = text[len(self.text):] if text.startswith(self.text) else text
        new_tokens = list(out.token_ids[self.tokens:])
        self.text, self.tokens = text, len(out.token_ids)
        return new_text, new_tokens
