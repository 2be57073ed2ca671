"""Server-sent events for a streaming response: one ``data:`` line per chunk, ``data: [DONE]``
last.

A response of several choices (``n``, a list of prompts) interleaves their chunks as their
tokens come, each chunk naming its choice's index: one task per choice's stream feeds a queue.
A failure after the stream has started (say, every rank that held a request died) cannot
change the status code any more: it is sent as an error object, then ``[DONE]``. When the
client disconnects, the server cancels this generator, which cancels the feeding tasks: each
pool stream closed that way aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import msgspec

from lmpool.frontend.serve.errors import error_body, message_of, status_of
from lmpool.frontend.serve.responses import Choice, Deltas, Shape, finish_reason
from lmpool.outputs import RequestOutput

DONE = b"data: [DONE]\n\n"


def data(obj: dict) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def event_stream(choices: list[Choice], firsts: list[RequestOutput],
                       streams: list[AsyncGenerator[RequestOutput, None]],
                       shape: Shape, include_usage: bool) -> AsyncIterator[bytes]:
    """The chunks of every choice: each one's first output (already awaited), then the rest as they come."""
    deltas = [Deltas(choice, shape.text is not None) for choice in choices]
    lasts = list(firsts)
    queue: asyncio.Queue = asyncio.Queue()
    running = [i for i, out in enumerate(firsts) if out.finish_reason is None]
    feeders = [asyncio.ensure_future(_feed(i, streams[i], queue)) for i in running]
    try:
        for i, out in enumerate(firsts):
            yield _chunk(shape, deltas[i], out, first=True)
        for _ in running:  # each feeder's stream ends once
            while (item := await queue.get())[1] is not None:
                i, out = item
                if isinstance(out, BaseException):
                    raise out
                lasts[i] = out
                yield _chunk(shape, deltas[i], out)
        if include_usage:
            yield data(shape.usage_chunk(list(zip(choices, lasts))))
    except Exception as exc:  # a failure mid-stream: the caller hears of it in-band
        yield data(error_body(status_of(exc), message_of(exc)))
    finally:
        for feeder in feeders:
            feeder.cancel()
            with contextlib.suppress(BaseException):
                await feeder
        for stream in streams:
            await stream.aclose()  # aborts a request still running (a no-op for one that ended)
    yield DONE


async def _feed(index: int, stream: AsyncIterator[RequestOutput], queue: asyncio.Queue) -> None:
    """Put ``stream``'s outputs on ``queue`` as ``(index, output)``, then ``(index, None)``;
    a failure goes as the output."""
    try:
        async for out in stream:
            queue.put_nowait((index, out))
            if out.finish_reason is not None:
                break
    except Exception as exc:
        queue.put_nowait((index, exc))
    queue.put_nowait((index, None))


def _chunk(shape: Shape, deltas: Deltas, out: RequestOutput, first: bool = False) -> bytes:
    piece, offset = deltas.step(out)
    return data(shape.chunk(deltas.choice, piece, finish_reason(deltas.choice, out), first=first, offset=offset))
