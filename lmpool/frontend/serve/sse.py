"""Server-sent events for a streaming response: one ``data:`` line per chunk, ``data: [DONE]``
last.

A failure after the stream has started (say, every rank that held the request died) cannot
change the status code any more: it is sent as an error object, then ``[DONE]``. When the
client disconnects, the server cancels this generator, and closing the pool's stream aborts
the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from lmpool.outputs import RequestOutput
from lmpool.frontend.serve.errors import error_body, message_of, status_of
from lmpool.frontend.serve.responses import Deltas, Shape

DONE = b"data: [DONE]\n\n"


def data(obj: dict) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def event_stream(first: RequestOutput, outputs: AsyncIterator[RequestOutput], shape: Shape,
                       include_usage: bool) -> AsyncIterator[bytes]:
    deltas = Deltas()
    out, last, opening = first, first, True
    try:
        while out is not None:
            text, tokens = deltas.step(out)
            yield data(shape.chunk(text, tokens, out.finish_reason, first=opening))
            opening, last = False, out
            out = await anext(outputs, None)
        if include_usage:
            yield data(shape.usage_chunk(last))
    except Exception as exc:  # a failure mid-stream: the caller hears of it in-band
        yield data(error_body(status_of(exc), message_of(exc)))
    finally:
        await outputs.aclose()  # aborts the request if it is still running
    yield DONE
