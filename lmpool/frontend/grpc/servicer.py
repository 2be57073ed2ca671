"""smg's engine service (``vllm.grpc.engine.VllmEngine``) over one ``AsyncLMPool``.

smg tells a gRPC worker's engine by which service answers ``HealthCheck`` (it tries SGLang's,
then vLLM's...): this one is vLLM's, whose requests are token ids in and token ids out (smg
tokenizes, renders chat templates and detokenizes, with the tokenizer bundle ``GetTokenizer``
sends). The host is one worker to smg, with one data-parallel rank: the pool routes each request
among its replicas itself, and publishes their KV caches as the host's (``host_events``).

Invariants: handlers use the pool's public API only; a request the pool or this module refuses
(bad ids, unsupported settings) is ``INVALID_ARGUMENT``, a pool with no live rank
``UNAVAILABLE``, and neither reaches or harms the pool; a ``Generate`` whose stream is dropped
is cancelled by grpc, which aborts its request in the pool (its blocks freed), and an ``Abort``
for its id does the same.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_servicer.kv_events import convert_batch
from smg_grpc_servicer.tokenizer_bundle import tokenizer_bundle, tokenizer_chunks

from lmpool.frontend.client import PoolError
from lmpool.frontend.grpc.event_feed import PoolEventFeed
from lmpool.frontend.grpc.sampling import sampling_params
from lmpool.frontend.serve.app import longest_request
from lmpool.frontend.serve.ecosystem import host_load, lmpool_version
from lmpool.frontend.serve.settings import ServeSettings
from lmpool.model.config import ModelConfig

log = logging.getLogger("uvicorn.error")


def _code(error: Exception) -> grpc.StatusCode:
    if isinstance(error, PoolError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(error, (ValueError, TypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


class PoolEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, pool, settings: ServeSettings, feed: PoolEventFeed) -> None:
        self.pool, self.settings, self.feed = pool, settings, feed
        self.model_config = ModelConfig.from_pretrained(settings.model)
        self.started = time.time()
        # One thread: a Hugging Face tokenizer is not safe to use from several at once.
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="lmpool-grpc-tokenize")

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    # ---- generation ---------------------------------------------------------------------

    async def Generate(self, request, context):
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        try:
            ids = await self._prompt_ids(request)
            params = sampling_params(request.sampling_params, max(1, longest_request(self.pool) - len(ids)))
            outputs = self.pool.stream(ids, params, request_id=request_id)
            sent = 0
            async for out in outputs:
                if request.stream:
                    yield _chunk(out, out.token_ids[sent:])
                    sent = len(out.token_ids)
                if out.finish_reason is not None:
                    yield _complete(out, out.token_ids[-1:] if request.stream else out.token_ids)
        except Exception as e:  # noqa: BLE001 - every failure is the request's status, never the server's
            if _code(e) is grpc.StatusCode.INTERNAL:
                log.exception("Generate %s failed", request_id)
            await context.abort(_code(e), str(e))

    async def _prompt_ids(self, request) -> list[int]:
        if request.WhichOneof("input") == "tokenized":
            return list(request.tokenized.input_ids)
        if request.WhichOneof("input") == "text":
            # Off the event loop, as the HTTP server tokenizes: a long text takes seconds.
            return await asyncio.get_running_loop().run_in_executor(self._tokenizing, self.pool.encode, request.text)
        raise ValueError("the request has no input (tokenized or text)")

    async def Abort(self, request, context):
        for request_id in request.request_ids:
            await self.pool.abort(request_id)
        return vllm_engine_pb2.AbortResponse()

    # ---- what smg reads of the host ------------------------------------------------------

    async def HealthCheck(self, request, context):
        stats = await self.pool.stats()
        healthy = any(rank["alive"] for rank in stats["ranks"])
        return vllm_engine_pb2.HealthCheckResponse(healthy=healthy, message="ok" if healthy else "no rank is alive")

    async def GetModelInfo(self, request, context):
        config, tokenizer = self.model_config, self.pool.tokenizer
        context_length = self.pool.client.max_model_len
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=self.settings.model, served_model_name=self.settings.name, is_generation=True,
            max_context_length=context_length, max_req_input_len=context_length, vocab_size=config.vocab_size,
            tokenizer_path=self.settings.model, model_type="qwen3", architectures=["Qwen3ForCausalLM"],
            eos_token_ids=list(config.eos_token_ids),
            bos_token_id=config.bos_token_id if config.bos_token_id is not None else -1,
            pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0)

    async def GetServerInfo(self, request, context):
        load = await host_load(self.pool)
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=load["running"] + load["waiting"], uptime_seconds=time.time() - self.started,
            last_receive_timestamp=time.time(), server_type="lmpool-grpc", data_parallel_size=1,
            block_size=self.pool.client.block_size, max_num_seqs=load["max_running"],
            model_dtype=str(self.pool.config.engine.dtype or ""))

    async def GetLoads(self, request, context):
        """The live ranks as one scheduler, as ``/v1/loads`` reports them over HTTP."""
        load = await host_load(self.pool)
        if not load["live_ranks"]:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no rank is alive")
        snapshot = vllm_engine_pb2.SchedulerLoad(
            dp_rank=0, num_running_reqs=load["running"], num_waiting_reqs=load["waiting"],
            num_total_reqs=load["running"] + load["waiting"], num_used_tokens=load["used_tokens"],
            max_total_num_tokens=load["total_tokens"], token_usage=load["usage"], cache_hit_rate=load["hit_rate"],
            max_running_requests=load["max_running"])
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        return vllm_engine_pb2.GetLoadsResponse(timestamp=now, version=lmpool_version(), dp_rank_count=1,
                                                loads=[snapshot])

    async def GetTokenizer(self, request, context):
        if self.pool.tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the model directory has no tokenizer")
        data, sha256 = await tokenizer_bundle(self.settings.model)
        for chunk in tokenizer_chunks(data, sha256):
            yield chunk

    async def SubscribeKvEvents(self, request, context):
        """The host's KV events (``host_events``): from ``start_sequence_number`` on where this
        host still holds them, else ``OUT_OF_RANGE`` (smg then clears the host and asks for 0);
        0 is the whole state as one batch, then every batch after it. A subscriber that falls
        out of the buffer gets ``DATA_LOSS`` (smg re-reads the state)."""
        view, start = self.feed.view, request.start_sequence_number
        batches = [view.snapshot()] if start == 0 else view.since(start)
        if batches is None:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"sequence {start} is not held by this host")
        await context.send_initial_metadata(())
        event_id = 0
        while True:
            for batch in batches:
                proto, event_id = convert_batch(batch, batch.seq, event_id)
                yield proto
            cursor = batches[-1].seq if batches else view.seq
            if not await self.feed.wait_past(cursor):
                return  # the server is stopping
            batches = view.since(cursor + 1)
            if batches is None:
                await context.abort(grpc.StatusCode.DATA_LOSS, "the subscriber fell behind the host's buffer")


def _chunk(out, new_tokens: list[int]):
    return vllm_engine_pb2.GenerateResponse(chunk=vllm_engine_pb2.GenerateStreamChunk(
        token_ids=new_tokens, prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(new_tokens),
        cached_tokens=out.num_cached_tokens))


def _complete(out, output_ids: list[int]):
    """The end of a request; a stream's carries its last token again, as vLLM's servicer sends it."""
    return vllm_engine_pb2.GenerateResponse(complete=vllm_engine_pb2.GenerateComplete(
        output_ids=output_ids, finish_reason=out.finish_reason, prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=len(out.token_ids), cached_tokens=out.num_cached_tokens))

