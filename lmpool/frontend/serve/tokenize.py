"""vLLM's tokenizer routes: ``/tokenize`` and ``/detokenize``.

``POST /tokenize`` takes a ``prompt`` (text) or ``messages`` (rendered with the chat template as a
chat request is, ``chat_template_kwargs`` included) and answers ``{"count", "max_model_len",
"tokens", "token_strs"}`` (the strings only with ``return_token_strs``); ``POST /detokenize``
takes ``tokens`` and answers ``{"prompt"}``, refusing an id outside the vocabulary. Bodies are
read and decoded as the completion routes' are (``body.parse_request``), and the tokenizer runs
off the event loop, on the server's one tokenizing thread.
"""

from __future__ import annotations

import asyncio
import functools

from fastapi import FastAPI, Request

from lmpool.frontend.serve.errors import ServeError
from lmpool.frontend.serve.protocol import DetokenizeRequest, TokenizeRequest


def register(app: FastAPI, request_for) -> None:
    """``request_for(request, model, endpoint)`` is the app's: a body parsed and the pool it names."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        parsed, pool = await request_for(request, TokenizeRequest, "tokenize")
        body = parsed.request
        if isinstance(parsed.prompt, str):
            tokens = await off_loop(request, _encode_text, pool.tokenizer, parsed.prompt, body.add_special_tokens)
        else:
            tokens = await off_loop(request, pool.encode_chat, parsed.prompt, **(body.chat_template_kwargs or {}))
        strs = await off_loop(request, pool.tokenizer.convert_ids_to_tokens, tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": pool.client.max_model_len, "tokens": tokens,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        parsed, pool = await request_for(request, DetokenizeRequest, "detokenize")
        check_ids(parsed.prompt, pool.client.model_config.vocab_size)
        if pool.tokenizer is None:
            raise ServeError(400, "this model directory has no tokenizer")
        return {"prompt": await off_loop(request, pool.output_processor.decode, parsed.prompt)}


def _encode_text(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model directory has no tokenizer")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_ids(tokens: list[int], vocab_size: int) -> None:
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            raise ValueError(f"token {t} at position {i} is outside the vocabulary [0, {vocab_size})")


async def off_loop(request: Request, work, /, *args, **kwargs):
    """``work(*args, **kwargs)`` on the server's tokenizing thread. Off the event loop: a prompt of
    megabytes takes seconds to tokenize, which there would stall every other request's stream
    and /health (the tokenizer releases the GIL)."""
    return await asyncio.get_running_loop().run_in_executor(request.app.state.tokenizing,
                                                            functools.partial(work, *args, **kwargs))
