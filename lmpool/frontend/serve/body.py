"""Reading a request body within its size limit, and decoding it without stalling the event loop.

Every route that takes a body reads it with ``parse_request``, which

- refuses a body over ``HttpLimits.max_request_bytes`` with a 413: at once from its
  Content-Length, before a byte of it is read, or, for a chunked body, as soon as what has been
  read passes the limit (nothing more is read into the server). The connection stays usable:
  uvicorn drops the rest of an answered request's body as it arrives, without buffering it, and
  ``http_limits`` closes the connection only past twice the limit of that (closing at once would
  lose the client its 413: the kernel resets a connection closed on unread data);
- decodes a body of at most ``inline_parse_bytes`` on the event loop (a few milliseconds at most)
  and a larger one in the body-parsing process (``body_worker``): the loop only waits for the
  answer, then rebuilds the model on a thread that hands the GIL back between pieces. Either way
  the model, or the 400 message, is the one FastAPI gave for a body parameter.

The parsing process takes one body at a time, in the order they come; it is started with the app
(or on first use) and stopped with it, and one that dies or overruns ``parse_timeout_s`` is killed
and replaced, failing only the body it was working on.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request

from lmpool.frontend.serve import body_worker
from lmpool.frontend.serve.disconnect import ClientGone
from lmpool.frontend.serve.errors import ServeError
from lmpool.frontend.serve.settings import HttpLimits

# "lmpool." in its command line makes the process one of the server's lmpool children to the
# tests' leak checks; -P keeps the script's own folder (which holds modules named like the
# standard library's) off its import path.
WORKER_ARGV = [sys.executable, "-P", str(Path(body_worker.__file__).resolve()), "lmpool.frontend.serve.body_worker"]
READ_LIMIT = 1 << 20  # the answer pipe's buffer


async def parse_request(request: Request, model: type[BaseModel]) -> BaseModel:
    """The request's body as ``model``; ``ServeError`` 413 or 400, or ``ClientGone``."""
    limits: HttpLimits = request.app.state.settings.limits
    body = await read_body(request, limits.max_request_bytes)
    content_type = request.headers.get("content-type")
    if len(body) <= limits.inline_parse_bytes:
        try:
            return body_worker.decode(model, content_type, body)
        except body_worker.BodyInvalid as e:
            raise ServeError(400, str(e)) from None
    return await request.app.state.body_parser.parse(model, content_type, body)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with a 413 past ``limit`` bytes (this module's docstring says how)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:  # httptools refuses a malformed one
        raise ServeError(413, f"the request body ({int(declared)} bytes) is larger than the {limit}-byte limit")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ServeError(413, f"the request body is larger than the {limit}-byte limit")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


class BodyParser:
    """The body-parsing process, seen from the server: ``parse`` one body, ``close`` at the end."""

    def __init__(self, timeout_s: float, argv: list[str] | None = None) -> None:
        self.timeout_s = timeout_s
        self.argv = argv or WORKER_ARGV
        self.process: asyncio.subprocess.Process | None = None
        self._turn = asyncio.Lock()  # one body at a time through the pipe, first come first served
        # Rebuilding a model holds the GIL a piece at a time; one thread does all of it.
        self._rebuild = ThreadPoolExecutor(1, thread_name_prefix="lmpool-body")

    async def start(self) -> None:
        """Start the process, and wait until it has loaded what it decodes with."""
        await self._exchange(pickle.dumps(None), b"")

    async def parse(self, model: type[BaseModel], content_type: str | None, body: bytes) -> BaseModel:
        # Shielded: a handler cancelled mid-exchange must not leave the next one its answer (the
        # exchange runs to its end; its outcome is then dropped, not logged as never retrieved).
        exchange = asyncio.ensure_future(self._exchange(pickle.dumps((model, content_type)), body))
        exchange.add_done_callback(lambda task: task.cancelled() or task.exception())
        kind, payload = await asyncio.shield(exchange)
        if kind == body_worker.INVALID:
            raise ServeError(400, bytes(payload).decode())
        if kind != body_worker.OK:
            raise ServeError(500, f"the body-parsing process failed: {bytes(payload).decode()}")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._rebuild, body_worker.unpack, payload)

    async def _exchange(self, meta: bytes, body: bytes) -> tuple[bytes, memoryview]:
        async with self._turn:
            process = await self._running()
            try:
                return await asyncio.wait_for(self._ask(process, meta, body), self.timeout_s)
            except asyncio.TimeoutError:
                await self._stop(kill=True)
                raise ServeError(413, f"the request body took longer than {self.timeout_s:g} s to parse") from None
            except (ConnectionError, asyncio.IncompleteReadError):
                await self._stop(kill=True)
                raise ServeError(500, "the body-parsing process exited") from None

    @staticmethod
    async def _ask(process: asyncio.subprocess.Process, meta: bytes, body: bytes) -> tuple[bytes, memoryview]:
        process.stdin.write(len(meta).to_bytes(8, "big") + meta + len(body).to_bytes(8, "big"))
        process.stdin.write(body)
        await process.stdin.drain()
        size = int.from_bytes(await process.stdout.readexactly(8), "big")
        # Read into its place a pipe's buffer at a time: the loop never copies the whole answer
        # (a reader's buffer grown to tens of megabytes, then sliced, cost it 100 ms at once).
        frame = memoryview(bytearray(size))
        got = 0
        while got < size:
            chunk = await process.stdout.read(min(size - got, READ_LIMIT))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", size)
            frame[got:got + len(chunk)] = chunk
            got += len(chunk)
        return bytes(frame[:1]), frame[1:]

    async def _running(self) -> asyncio.subprocess.Process:
        if self.process is None or self.process.returncode is not None:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=READ_LIMIT)
        return self.process

    async def _stop(self, kill: bool) -> None:
        process, self.process = self.process, None
        if process is None or process.returncode is not None:
            return
        if kill:
            process.kill()
        else:
            process.stdin.close()  # the process exits at the end of its stdin
        try:
            await asyncio.wait_for(process.wait(), 10)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()

    async def close(self) -> None:
        """Stop the process (it finishes the body it is on) and the rebuilding thread."""
        with contextlib.suppress(Exception):
            async with self._turn:
                await self._stop(kill=False)
        self._rebuild.shutdown(wait=False, cancel_futures=True)
