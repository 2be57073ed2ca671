"""The OpenAI-compatible HTTP app over one ``AsyncLMPool``.

``create_app(settings)`` builds a FastAPI app whose lifespan starts the pool on the server's
own event loop (logging a line with its id, ranks, devices, KV blocks and the ``lmpool top``
command) and shuts it down with the server. Handlers use the pool's public API (``encode``,
``encode_chat``, ``stream``, ``generate``, ``stats``), and read from its client
(``pool.client``) what that API does not give: the ranks (their KV blocks and liveness), the
block size and the context length. A request whose client disconnects is aborted: a stream's
consumer is cancelled by the server, a non-streaming handler races its request against the
client's disconnect (``disconnect``). Request bodies are read and decoded by
``body.parse_request`` (a size limit; large bodies decoded off the event loop), not by FastAPI.
The routes gateways probe (``/server_info``, ``/v1/loads``...) are ``ecosystem``'s.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmpool.frontend.api import AsyncLMPool
from lmpool.frontend.serve import ecosystem, tokenize
from lmpool.frontend.serve.auth import install_api_key
from lmpool.frontend.serve.body import BodyParser, parse_request
from lmpool.frontend.serve.body_parser import Parsed
from lmpool.frontend.serve.choices import Run, generate_all, plan, start_streams
from lmpool.frontend.serve.disconnect import unless_disconnected
from lmpool.frontend.serve.errors import ServeError, install_handlers
from lmpool.frontend.serve.logprobs import TokenText
from lmpool.frontend.serve.metrics import scrape
from lmpool.frontend.serve.protocol import (
    DEFAULT_COMPLETION_TOKENS,
    ChatCompletionRequest,
    ChatFields,
    CompletionFields,
    CompletionRequest,
    DetokenizeFields,
    PromptList,
    SamplingFields,
    TokenizeFields,
)
from lmpool.frontend.serve.responses import Shape, server_fingerprint
from lmpool.frontend.serve.settings import ServeSettings
from lmpool.frontend.serve.sse import event_stream
from lmpool.frontend.serve.tokenize import off_loop

log = logging.getLogger("uvicorn.error")  # uvicorn's own start-up log: its handler and --log-level apply


def started_line(pool: AsyncLMPool) -> str:
    """What a user needs to find the pool again: its id, ranks, devices and KV blocks, and how to watch it."""
    config, ranks = pool.config, pool.client.ranks
    per_rank = ", ".join(f"r{r.rank} {config.device_of(r.rank)} {r.num_blocks} blocks" for r in ranks)
    return (f"pool {pool.pool_id} started: {len(ranks)} ranks ({per_rank}) of {config.engine.block_size}-token "
            f"KV blocks, routing {config.routing}; watch it with: lmpool top {pool.pool_id}")


def create_app(settings: ServeSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        grpc_worker = getattr(app.state, "grpc", None)  # lmpool serve --grpc-port
        try:
            await app.state.body_parser.start()  # ready before the first large body
            if grpc_worker is not None:
                grpc_worker.connect()  # before the pool binds its KV-event publisher
            async with AsyncLMPool(settings.model, served_model_name=settings.name, **settings.pool_args) as pool:
                app.state.pool = pool
                log.info("%s", started_line(pool))
                if grpc_worker is not None:
                    await grpc_worker.start(pool, settings)
                try:
                    yield
                finally:
                    if grpc_worker is not None:  # SIGTERM's drain, begun with the grace, runs to its end
                        await grpc_worker.stop(0)
        finally:
            if grpc_worker is not None:
                await grpc_worker.stop(0)  # its private sockets' directory, when the pool failed to start
            app.state.tokenizing.shutdown(wait=False, cancel_futures=True)
            await app.state.body_parser.close()

    app = FastAPI(title="LMPool", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.settings = settings
    # One thread: a Hugging Face tokenizer is not safe to reconfigure from several at once.
    app.state.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="lmpool-tokenize")
    app.state.body_parser = BodyParser(settings.limits.parse_timeout_s)
    install_handlers(app)
    install_api_key(app, settings.api_key)
    _routes(app, settings)
    ecosystem.register(app)
    tokenize.register(app, request_for)
    return app


def _routes(app: FastAPI, settings: ServeSettings) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        parsed, pool = await request_for(request, CompletionRequest, "completions")
        body = parsed.request
        assert isinstance(body, CompletionFields)  # the request, or its head (HEADS) from the parsing process
        # A completion's prompt (CompletionRequest.prompt_input): text or token ids, or a list of them.
        prompt = cast(str | list[int] | PromptList, parsed.prompt)
        prompts: list[str | list[int]] = list(prompt) if isinstance(prompt, PromptList) else [prompt]
        ids = [await off_loop(request, pool.encode, prompt) for prompt in prompts]
        if body.prompt_only:
            _room_to_score(ids, _max_model_len(pool))
        echoes = [await _prompt_text(request, pool, p, i) for p, i in zip(prompts, ids)] if body.echo else None
        params = body.sampling_params(DEFAULT_COMPLETION_TOKENS)
        runs = plan(ids, params, body.num_choices, echoes, body.prompt_only)
        return await _respond(request, pool, runs, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        parsed, pool = await request_for(request, ChatCompletionRequest, "chat")
        body = parsed.request
        assert isinstance(body, ChatFields)  # the request, or its head (HEADS) from the parsing process
        prompt_ids = await off_loop(request, pool.encode_chat, parsed.prompt, **(body.chat_template_kwargs or {}))
        # OpenAI's chat default is "as long as the context allows".
        params = body.sampling_params(max(1, longest_request(pool) - len(prompt_ids)))
        return await _respond(request, pool, plan([prompt_ids], params, body.num_choices), body, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        pool = request.app.state.pool
        card = {"id": settings.name, "object": "model", "created": 0, "owned_by": "lmpool",
                "root": settings.model, "max_model_len": _max_model_len(pool)}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health(request: Request):
        stats = await request.app.state.pool.stats()
        if not any(rank["alive"] for rank in stats["ranks"]):
            raise ServeError(503, "no rank is alive")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(request: Request):
        return scrape(request.app.state.pool)


async def request_for(request: Request, model: type, endpoint: str) -> tuple[Parsed, AsyncLMPool]:
    """The request's body as ``model`` (``body.parse_request``) and the pool it names (a 404 for another
    model); ``ClientGone`` (a 499) if the client left while it was read."""
    parsed = await parse_request(request, model, endpoint)
    assert isinstance(parsed.request, (SamplingFields, TokenizeFields, DetokenizeFields))  # every request model's base
    return parsed, _pool(request, parsed.request.model)


def _pool(request: Request, model: str | None) -> AsyncLMPool:
    settings: ServeSettings = request.app.state.settings
    # No name, or an empty one, is the served model (as vLLM takes it: clients send "" unset).
    if model and model not in (settings.name, settings.model):
        raise ServeError(404, f"The model `{model}` does not exist.")
    return request.app.state.pool


async def _prompt_text(request: Request, pool: AsyncLMPool, prompt: str | list[int], ids: list[int]) -> str:
    """An echoed prompt's text: as sent, or its token ids decoded."""
    return prompt if isinstance(prompt, str) else (await off_loop(request, pool.output_processor.decode, ids) or "")


def _room_to_score(prompts: list[list[int]], max_model_len: int) -> None:
    """``max_tokens`` 0 (a prompt's logprobs alone): the pool computes one token to get them, so
    each prompt must leave room for it; a ``ValueError`` (a 400) naming the prompt where not."""
    for i, ids in enumerate(prompts):
        if len(ids) >= max_model_len:
            which = f"prompt {i}" if len(prompts) > 1 else "the prompt"
            raise ValueError(f"{which} ({len(ids)} tokens) leaves no room in max_model_len {max_model_len} for the "
                             f"one token the pool computes to score it (max_tokens 0): at most "
                             f"{max_model_len - 1} tokens")


def _max_model_len(pool: AsyncLMPool) -> int:
    # The engine's context length (what ingress validation checks prompts against).
    return pool.client.max_model_len


def longest_request(pool: AsyncLMPool) -> int:
    """The most tokens (prompt and output) a request can hold: the context, or less where no
    live rank's KV cache holds that many (a default beyond it would refuse every request); the
    HTTP and gRPC servers' default ``max_tokens`` is what it leaves after the prompt."""
    blocks = max((rank.num_blocks for rank in pool.client.ranks if rank.alive), default=0)
    return min(_max_model_len(pool), blocks * pool.client.block_size)


async def _respond(request: Request, pool: AsyncLMPool, runs: list[Run], body, chat: bool):
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    text = TokenText(pool.tokenizer) if body.logprob_fields() else None
    shape = Shape(chat, rid, request.app.state.settings.name, body.return_token_ids, server_fingerprint(), text)
    if not body.stream:
        outs = await unless_disconnected(request, generate_all(pool, runs, rid))
        return JSONResponse(shape.full([(run.choice, out) for run, out in zip(runs, outs)]))
    firsts, streams = await unless_disconnected(request, start_streams(pool, runs, rid))
    return StreamingResponse(event_stream([run.choice for run in runs], firsts, streams, shape, body.include_usage),
                             media_type="text/event-stream")
