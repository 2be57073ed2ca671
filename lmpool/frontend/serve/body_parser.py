"""Decoding a request body into its request, and the process that does it for large bodies.

``decode(model, content_type, body)`` validates a JSON body against its endpoint's request model
and resolves its prompt (``Parsed``), or raises ``BodyRefused`` with the status and message the
client gets: 415 for a body that is not JSON by its content type, 400 for anything the model or
its prompt refuses.

Run as ``python -m lmpool.frontend.serve.body_parser``, this module is the HTTP server's
body-parsing process. Neither ``json``, msgspec nor pydantic releases the GIL while it builds
Python objects, so a thread would not help: on the server's event loop a 32 MiB body is seconds of
decoding and validation, which pause every other request's stream. The process reads one
``ParseJob`` at a time on stdin and writes one answer for each on stdout, in order; every frame is
an 8-byte big-endian length and a msgpack message, never a pickle. A ``Parsed``
answer is ``Decoded``: the head's JSON (every field but the prompt, ``protocol.HEADS``) and the
resolved prompt in ``pieces`` the server rebuilds one at a time, handing its event loop back
between them (``body.rebuild``), so that even a prompt of millions of token ids holds the loop for
a millisecond at a time.

The process imports msgspec, pydantic and the request models only (the ``lmpool`` package loads
its engine lazily); it writes ``Ready`` once loaded, dies with its parent (``PR_SET_PDEATHSIG``)
and exits at the end of its stdin.
"""

from __future__ import annotations

import email.message
import gc
import sys
from dataclasses import dataclass

import msgspec
from pydantic import BaseModel, ValidationError

from lmpool.frontend.serve.protocol import (
    HEADS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    PromptList,
    RequestModel,
    TokenizeRequest,
)
from lmpool.frontend.serve.validation_errors import described

ENDPOINTS: dict[str, type[RequestModel]] = {"completions": CompletionRequest, "chat": ChatCompletionRequest,
                                         "tokenize": TokenizeRequest, "detokenize": DetokenizeRequest}
IDS_PIECE = 1 << 16  # token ids per piece: about a millisecond to decode
TEXT_PIECE = 1 << 20  # bytes of UTF-8 text per piece
MESSAGES_PIECE = 512  # messages per piece
PROMPTS_PIECE = 1  # prompts of a list of prompts per piece (each may be long)
# The most bytes of JSON a request's fields other than its prompt (or messages) may take: the
# server validates them again, on its event loop, from what the process sends (a millisecond or
# two at this size). Stop strings, stop token ids and template arguments fit many times over.
MAX_HEAD_BYTES = 256 * 1024


class BodyRefused(Exception):
    """A body the server refuses: ``status``, the message of the error body and its ``param``
    (the field at fault, as OpenAI names it; None for the body as a whole)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class Parsed:
    """A request's fields (``request``; its prompt or messages are not read again) and its
    resolved prompt: text, token ids, or a conversation of ``{"role", "content"}`` dicts."""

    request: BaseModel
    prompt: str | list[int] | list[dict] | PromptList


def decode(model: type[RequestModel], content_type: str | None, body: bytes) -> Parsed:
    """The request of ``body``, as ``model`` validates it, or ``BodyRefused``."""
    if content_type is not None and not is_json(content_type):
        raise BodyRefused(415, f"the body must be JSON (Content-Type: application/json), not {content_type!r}")
    if not body.strip():
        raise BodyRefused(400, "the request has no body: send a JSON object")
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        raise BodyRefused(400, *described(e.errors(include_url=False, include_input=False))) from None
    try:
        return Parsed(request, request.prompt_input())
    except ValueError as e:
        raise BodyRefused(400, str(e)) from None


def is_json(content_type: str) -> bool:
    """application/json or application/*+json, parameters aside."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


# The frames between the server and the process.
class ParseJob(msgspec.Struct, tag="job", array_like=True):
    endpoint: str  # a key of ENDPOINTS
    content_type: str | None
    body: bytes


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The process has loaded what it decodes with."""


class Decoded(msgspec.Struct, tag="decoded", array_like=True):
    """A valid request: its head's JSON and its prompt, as ``kind`` ("text", "ids", "messages"
    or "prompts") of ``size`` characters, ids, messages or prompts, in pieces."""

    head: bytes
    kind: str
    size: int
    pieces: list[bytes]


class Refused(msgspec.Struct, tag="refused", array_like=True):
    status: int
    message: str
    param: str | None = None


Answer = Ready | Decoded | Refused


def answer(job: ParseJob) -> Decoded | Refused:
    """The process's answer to one job."""
    model = ENDPOINTS.get(job.endpoint)
    if model is None:
        return Refused(500, f"no request model for endpoint {job.endpoint!r}")
    try:
        parsed = decode(model, job.content_type, job.body)
        head = parsed.request.model_dump_json(include=set(HEADS[model].model_fields))
        if len(head) > MAX_HEAD_BYTES:
            raise BodyRefused(400, f"the request's fields other than its prompt take {len(head)} bytes of JSON, "
                                   f"more than the {MAX_HEAD_BYTES} allowed")
        return Decoded(head.encode(), *split(parsed.prompt))
    except BodyRefused as e:
        return Refused(e.status, str(e), e.param)
    except Exception as e:  # a bug, or an exhausted process: this body fails, not the process
        return Refused(500, f"the body could not be decoded: {type(e).__name__}: {e}")


def split(prompt: str | list[int] | list[dict] | PromptList) -> tuple[str, int, list[bytes]]:
    """``Decoded``'s kind, size and pieces of a resolved prompt (``body.rebuild`` undoes it)."""
    if isinstance(prompt, str):
        text = prompt.encode()
        return "text", len(prompt), [text[i:i + TEXT_PIECE] for i in range(0, len(text), TEXT_PIECE)]
    if isinstance(prompt, PromptList):
        kind, step = "prompts", PROMPTS_PIECE
    elif prompt and isinstance(prompt[0], dict):
        kind, step = "messages", MESSAGES_PIECE
    else:
        kind, step = "ids", IDS_PIECE
    encode = msgspec.msgpack.encode
    return kind, len(prompt), [encode(prompt[i:i + step]) for i in range(0, len(prompt), step)]


def _serve(stdin, stdout) -> None:
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ParseJob)
    _write(stdout, encoder.encode(Ready()))
    while True:
        size = stdin.read(8)
        if len(size) < 8:  # the server closed its end: done
            return
        frame = stdin.read(int.from_bytes(size, "big"))
        gc.disable()  # the objects decoded hold no cycles; collecting them on the way costs 2-4x
        try:
            reply = answer(decoder.decode(frame))
        finally:
            gc.enable()
        _write(stdout, encoder.encode(reply))


def _write(stdout, frame: bytes) -> None:
    stdout.write(len(frame).to_bytes(8, "big"))
    stdout.write(frame)
    stdout.flush()


def _main() -> None:
    import ctypes
    import os
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server
    if os.getppid() == 1:  # the server died before prctl took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    gc.freeze()  # what is loaded now stays: later collections need not look at it
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the answers
    _serve(stdin, stdout)


if __name__ == "__main__":
    _main()

