"""The pool's public API: ``AsyncLMPool`` for asyncio applications, ``LMPool`` for plain code.

``AsyncLMPool`` runs on the application's own event loop (asyncio or uvloop):
it starts the control process and the workers and exchanges messages with
them from that loop, never blocking it for long. ``LMPool`` owns a private
uvloop loop on a background thread and offers the same pool synchronously,
shaped like ``LLM.generate``.

``metrics=True`` turns on Prometheus metrics in this process (``metrics_registry``, which
``lmpool serve`` renders at its ``/metrics``); ``metrics_port`` (an int; 0 picks a free port) also
serves them at ``http://<metrics_host>:<port>/metrics`` (see ``lmpool.frontend.metrics``). Every
series is labelled ``model_name=served_model_name`` (the model's path unless given).

``routing`` names the policy (``lmpool.control.routing.registry.POLICIES``) and
``routing_config`` (``RoutingConfig``) its thresholds.

KV transfers: ``transfer_mode`` ("pull", the default: route-time pulls,
``lmpool.control.transfers.pull``; "background", "foreground", "both" or "all"; any but
"none" implies transfers, which also allow explicit ones, ``transfer``; with "none",
``enable_transfers=True`` allows explicit ones alone) runs the automatic policies,
with copies capped per chain and tick (``background_copy_max_blocks``; a longer chain goes on
in the next tick) and per pair and tick
(``background_copy_batch_max_blocks``), and their thresholds in ``transfer_policy``
(``TransferPolicyConfig``). ``stats()["transfers"]`` counts them. Between replicas on two
GPUs the blocks are pulled through CUDA IPC where the GPUs can address each other's memory
and packed over NCCL elsewhere; ``gpu_transfer_path="nccl"`` packs over NCCL between any two
GPUs (for peer access that is reported but slow or broken).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import threading
import time
from collections.abc import AsyncGenerator, Coroutine
from collections.abc import Sequence as SequenceABC
from typing import Any, TypeVar

import uvloop

from lmpool.config.engine import check_port
from lmpool.config.pool import PoolConfig
from lmpool.errors import ArgumentTypeError
from lmpool.frontend.client import PoolClient, PoolError, TrackedRequest
from lmpool.frontend.llm import Prompt, prepare_batch
from lmpool.frontend.metrics import NO_METRICS, PoolMetrics
from lmpool.frontend.output_processor import OutputProcessor, RequestState
from lmpool.frontend.turns import Turns
from lmpool.outputs import RequestOutput
from lmpool.sampling_params import SamplingParams
from lmpool.stop_strings import check_usable
from lmpool.tokenizer import encode_chat, encode_chats, encode_prompt, load_tokenizer
from lmpool_ipc import close_on_sigterm

_T = TypeVar("_T")


class AsyncLMPool:
    """N data-parallel replicas of one model behind one asyncio API.

    >>> async with AsyncLMPool("path/to/qwen3", world_size=4, device="cuda") as pool:
    ...     out = await pool.generate("Hello", SamplingParams(max_tokens=16))
    ...     async for partial in pool.stream("Hi", SamplingParams(max_tokens=16)):
    ...         print(partial.text)
    """

    def __init__(self, model: str, *, config: PoolConfig | None = None, metrics: bool = False,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 served_model_name: str | None = None, **options) -> None:
        """``options`` are ``PoolConfig``'s settings by name, flat (``world_size``, ``device``,
        ``routing``, ``routing_config``, ``transfer_mode``, ``block_size``, ...: see
        ``PoolConfig.from_options``); or pass a whole ``config``."""
        if config is not None and options:
            raise TypeError(f"give either config or pool options, not both (got {sorted(options)})")
        self.client = PoolClient(config if config is not None else PoolConfig.from_options(model, **options))
        self.tokenizer = load_tokenizer(self.config.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._prefix = secrets.token_hex(4)
        self._turns = Turns()  # for submissions' work before their route
        if not isinstance(metrics, bool):
            raise ArgumentTypeError(f"metrics must be a bool, got {metrics!r} ({type(metrics).__name__})")
        if served_model_name is not None and not isinstance(served_model_name, str):
            raise ArgumentTypeError(f"served_model_name must be a string or None, got {served_model_name!r}")
        self._metrics_address = (metrics_host, check_port(metrics_port, "metrics_port"))
        self._metrics_on = metrics or metrics_port is not None
        self.served_model_name = model if served_model_name is None else served_model_name
        self._metrics: PoolMetrics | None = None

    async def start(self) -> AsyncLMPool:
        await self.client.start()
        if self._metrics_on:
            try:
                self._metrics = self._start_metrics()
            except BaseException:
                await self.client.shutdown()
                raise
            self.client.metrics = self._metrics
        return self

    def _start_metrics(self) -> PoolMetrics:
        assert self.client.board is not None  # the started pool's
        metrics = PoolMetrics(self.client.board, self.served_model_name)
        host, port = self._metrics_address
        if port is not None:
            try:
                metrics.serve_http(port, host)
            except BaseException:  # say, the port is taken
                metrics.close()
                raise
        return metrics

    @property
    def pool_id(self) -> str:
        """The pool's id, as ``lmpool ps`` lists it and ``lmpool top`` takes it."""
        if self.client.ipc is None:
            raise PoolError("the pool is not started: its id is named when it starts")
        return self.client.ipc.pool_id

    @property
    def metrics_port(self) -> int | None:
        """The port serving ``/metrics``; None when metrics are off or served by no port."""
        return None if self._metrics is None else self._metrics.port

    @property
    def metrics_registry(self):
        """The ``prometheus_client`` registry of the pool's metrics; None when metrics are off."""
        return None if self._metrics is None else self._metrics.registry

    async def __aenter__(self) -> AsyncLMPool:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        if self._metrics is not None:
            metrics, self._metrics = self._metrics, None
            self.client.metrics = NO_METRICS
            # The HTTP server takes up to half a second to stop: not on the event loop.
            await asyncio.get_running_loop().run_in_executor(None, metrics.close)
        await self.client.shutdown()

    # ---- requests -----------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    async def submit(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        rank: int | None = None,
    ) -> TrackedRequest:
        """Validate and route one request (or send it to ``rank``); its tokens arrive on the
        returned request's queue."""
        if request_id is not None and not isinstance(request_id, str):  # it keys the pool's table, and outputs
            raise ArgumentTypeError(f"request_id must be a string or None, got {request_id!r} "
                                    f"({type(request_id).__name__})")
        rid = request_id if request_id is not None else f"{self._prefix}-{next(self._ids)}"
        params = SamplingParams() if params is None else params
        check_usable(params, self.tokenizer)  # the rest of params is validated at ingress
        # Turns at the loop for the CPU work before the route (``lmpool.frontend.turns``): a
        # burst's first requests are routed and handed over while its later ones wait their turn.
        submitted = time.monotonic()  # its times count from here, the wait for its turn included
        await self._turns.take()
        req = self.client.prepare(rid, self.encode(prompt), params, rank, arrival=submitted)
        return await self.client.launch(req, rank)

    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        rank: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """One ``RequestOutput`` per new token (cumulative); the last has ``finish_reason`` set.
        Leaving the loop early, or cancelling the consuming task, aborts the request.
        ``rank`` bypasses routing (for experiments and benchmarks). With stop strings, the
        request ends at the first one its text shows (``lmpool.stop_strings``)."""
        req = await self.submit(prompt, params, request_id, rank)
        state = self.output_processor.new_request(req.request_id, req.prompt_token_ids, req.params, stream=True)
        try:
            while (out := self._next_output(req, state, await req.queue.get())) is not None:
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            if req.finish_reason is None:  # ended here (a stop string, or the caller left): end it on its rank
                await self.client.abort(req.request_id)

    @staticmethod
    def _next_output(req: TrackedRequest, state: RequestState, item) -> RequestOutput | None:
        """What the stream shows for ``item``, the next entry of ``req``'s queue: a token's output,
        or at the end an aborted request's last one (None after any other end)."""
        if isinstance(item, BaseException):
            raise item
        # Read at every output: the rank and route change where a request is moved off a dead rank.
        state.num_cached_tokens, state.rank, state.route = req.num_cached_tokens, req.rank, req.route or None
        state.predicted_ttft_s = req.predicted_ttft_s
        state.dispatch_s = req.dispatched - req.arrival if req.dispatched else None
        state.queued_s, state.first_step_s, state.intake_s = req.queued_s, req.first_step_s, req.intake_s
        if item is None:
            return state.abort() if req.finish_reason == "abort" else None
        logprobs = () if item.logprobs is None else (item.logprobs,)
        return state.update([item.token_id], item.finish_reason if item.finished else None, logprobs,
                            item.prompt_logprobs)

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        rank: int | None = None,
    ) -> RequestOutput:
        """The finished output of one request."""
        last = None
        async for last in self.stream(prompt, params, request_id, rank):
            pass
        assert last is not None  # a stream ends with its request's finished output
        return last

    async def chat(
        self, messages: list[dict], params: SamplingParams | None = None, request_id: str | None = None,
        rank: int | None = None, **template_kwargs,
    ) -> RequestOutput:
        """``generate`` for a conversation (a list of ``{"role", "content"}`` dicts), rendered by
        the tokenizer's chat template with the assistant's turn opened. To stream one, pass
        ``encode_chat(messages)`` to ``stream``."""
        return await self.generate(self.encode_chat(messages, **template_kwargs), params, request_id, rank)

    def encode_chat(self, messages: list[dict], /, **template_kwargs) -> list[int]:
        return encode_chat(self.tokenizer, messages, **template_kwargs)

    async def transfer(self, prompt: Prompt, src: int, dst: int, move: bool = False):
        """Copy (or move) the KV of ``prompt``'s complete blocks from rank ``src`` to ``dst``
        (a pool started with ``enable_transfers=True``); returns the plan's ``TransferResult``.
        Blocks cached by a request whose output was returned count as held, even if
        the source's report of them has not reached the control plane yet."""
        return await self.client.transfer(self.encode(prompt), src, dst, move)

    async def abort(self, request_id: str) -> None:
        """Stop a request; an unknown or finished id is a no-op."""
        await self.client.abort(request_id)

    async def reset(self, **options) -> None:
        """Forget every cached prefix and restart the control plane, optionally with another
        ``routing``, ``routing_config``, ``transfer_mode`` or ``kv_events``: the pool then serves as a freshly
        started one, in a fraction of a start's time (``PoolClient.reset``). Only when idle."""
        await self.client.reset(**options)

    @property
    def config(self) -> PoolConfig:
        """The settings the pool runs with: those it started with, with the GPUs this process sees
        (``with_gpus``), as its last ``reset`` left them."""
        return self.client.config

    async def stats(self) -> dict:
        """Pool state: ``control_pid``, per-rank rows and the ``transfers`` counters (see
        ``PoolClient.stats`` and ``TransferStats``)."""
        return await self.client.stats()


async def _cancelled(started: list[asyncio.Task]) -> None:
    """Cancel the task in ``started`` (if it got going) and wait until it has unwound."""
    for task in started:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


class LMPool:
    """The pool for synchronous code: ``LMPool(model, world_size=4).generate(prompts, params)``."""

    def __init__(self, model: str, **pool_args) -> None:
        close_on_sigterm()  # the pool starts on the loop's thread, where no handler can be set: here, if main
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lmpool-loop", daemon=True)
        self._thread.start()
        try:
            self._pool = self._call(self._create(model, pool_args))
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _create(model: str, pool_args: dict) -> AsyncLMPool:
        return await AsyncLMPool(model, **pool_args).start()

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` on the pool's loop and wait for it. If the wait is interrupted (Ctrl-C),
        the call is cancelled there, and waited for, before the interruption goes on: its
        streams abort their requests, as an interrupted ``LLM.generate`` leaves nothing behind."""
        if self._loop.is_closed():
            coro.close()  # never to be awaited
            raise PoolError("the pool is shut down")
        started: list[asyncio.Task] = []

        async def run():
            started.append(asyncio.current_task())
            return await coro

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return future.result()
        except BaseException:
            if not future.done():
                future.cancel()  # a call not yet started on the loop never starts
                asyncio.run_coroutine_threadsafe(_cancelled(started), self._loop).result()
                if not started:
                    coro.close()  # it never ran: close it rather than leave it unawaited
            raise

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        rank: int | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``; every prompt is checked before any is sent.
        ``rank`` runs them all there, bypassing routing (as ``AsyncLMPool.generate``'s)."""
        pool = self._pool

        def validate(ids: list[int], p: SamplingParams) -> None:
            check_usable(p, pool.tokenizer)
            pool.client.check_request("", ids, p)

        token_lists, params = prepare_batch(prompts, sampling_params, pool.encode, validate)

        async def run_all() -> list[RequestOutput]:
            runs = (pool.generate(ids, p, rank=rank) for ids, p in zip(token_lists, params))
            return list(await asyncio.gather(*runs))

        return self._call(run_all())

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        rank: int | None = None,
        **template_kwargs,
    ) -> list[RequestOutput]:
        """``generate`` for one conversation or a list of them (as ``LLM.chat``)."""
        return self.generate(encode_chats(self._pool.tokenizer, conversations, template_kwargs), sampling_params,
                             rank)

    def stats(self) -> dict:
        return self._call(self._pool.stats())

    def reset(self, **options) -> None:
        """``AsyncLMPool.reset``: forget every cached prefix, optionally switch routing."""
        self._call(self._pool.reset(**options))

    def transfer(self, prompt: Prompt, src: int, dst: int, move: bool = False):
        """``AsyncLMPool.transfer``: copy (or move) a prompt's cached blocks between ranks."""
        return self._call(self._pool.transfer(prompt, src, dst, move))

    @property
    def client(self) -> PoolClient:
        return self._pool.client

    @property
    def pool_id(self) -> str:
        return self._pool.pool_id

    @property
    def metrics_port(self) -> int | None:
        return self._pool.metrics_port

    @property
    def metrics_registry(self):
        return self._pool.metrics_registry

    def shutdown(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self._pool.shutdown())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> LMPool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
