"""Reading a request body within its size limit, and decoding it without stalling the event loop.

Every route that takes a body reads it with ``parse_request``, which

- refuses a body over ``HttpLimits.max_request_bytes`` with a 413: at once from its
  Content-Length, before a byte of it is read, or, for a chunked body, as soon as what has been
  read passes the limit (nothing more is read into the server). The connection stays usable:
  uvicorn drops the rest of an answered request's body as it arrives, without buffering it, and
  ``http_limits`` closes the connection only past twice the limit of that;
- decodes a body of at most ``inline_parse_bytes`` on the event loop (a few milliseconds at most)
  and a larger one in the body-parsing process (``body_parser``), whose answer is rebuilt a piece
  at a time with the loop handed back between pieces (``rebuild``).

The parsing process takes one body at a time, in the order they come; it is started with the app
and stopped with it, and one that dies or overruns ``parse_timeout_s`` is killed and replaced,
failing only the body it was working on.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import msgspec
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from lmpool.frontend.serve.body_parser import Answer, BodyRefused, Decoded, Parsed, ParseJob, Ready, Refused, decode
from lmpool.frontend.serve.disconnect import ClientGone
from lmpool.frontend.serve.errors import ServeError
from lmpool.frontend.serve.protocol import HEADS, PromptList, RequestModel
from lmpool.frontend.serve.settings import HttpLimits
from lmpool.frontend.serve.validation_errors import described

PARSER_ARGV = [sys.executable, "-m", "lmpool.frontend.serve.body_parser"]
READ_CHUNK = 1 << 20  # bytes of an answer read at a time


async def parse_request(request: Request, model: type[RequestModel], endpoint: str) -> Parsed:
    """The request's body as ``model`` (``endpoint``'s, in ``body_parser.ENDPOINTS``), resolved;
    ``ServeError`` 413, 415 or 400, or ``ClientGone``."""
    limits: HttpLimits = request.app.state.settings.limits
    body = await read_body(request, limits.max_request_bytes)
    content_type = request.headers.get("content-type")
    if len(body) <= limits.inline_parse_bytes:
        try:
            return decode(model, content_type, body)
        except BodyRefused as e:
            raise ServeError(e.status, str(e), e.param) from None
    decoded = await request.app.state.body_parser.parse(ParseJob(endpoint, content_type, body))
    return Parsed(_head(HEADS[model], decoded.head), await rebuild(decoded))


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


def _head(model: type[BaseModel], head: bytes) -> BaseModel:
    # Validated in the process already; again here, as it crossed a process boundary.
    try:
        return model.model_validate_json(head)
    except ValidationError as e:
        raise ServeError(500, f"the body-parsing process sent an invalid request: {described(e.errors())[0]}")


PIECE_TYPES = {"ids": list[int], "messages": list[dict[str, str]], "prompts": list[str | list[int]]}


async def rebuild(decoded: Decoded) -> str | list[int] | list[dict] | PromptList:
    """The prompt of ``decoded``, a piece at a time, the loop handed back after each."""
    if decoded.kind == "text":
        return b"".join(decoded.pieces).decode()  # a copy at memory speed: milliseconds for 32 MiB
    piece_type = PIECE_TYPES[decoded.kind]
    # Items go into a list of their final size: growing one of millions reallocates it, tens
    # of milliseconds of copying at a time.
    items: list = [None] * decoded.size
    at = 0
    for piece in decoded.pieces:
        part = msgspec.msgpack.decode(piece, type=piece_type)
        items[at:at + len(part)] = part
        at += len(part)
        await asyncio.sleep(0)
    if at != decoded.size:
        raise ServeError(500, f"the body-parsing process sent {at} of {decoded.size} prompt items")
    return PromptList(items) if decoded.kind == "prompts" else items


class BodyParser:
    """The body-parsing process, seen from the server: ``start``, ``parse`` bodies, ``close``."""

    def __init__(self, timeout_s: float, argv: list[str] | None = None) -> None:
        self.timeout_s = timeout_s
        self.argv = argv or PARSER_ARGV
        self.process: asyncio.subprocess.Process | None = None
        self._turn = asyncio.Lock()  # one body at a time through the pipe, first come first served
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Answer)

    async def start(self) -> None:
        """Start the process, and wait until it has loaded what it decodes with."""
        async with self._turn:
            await self._running()

    async def parse(self, job: ParseJob) -> Decoded:
        """The process's ``Decoded`` answer to ``job``; ``ServeError`` for a refusal."""
        # Shielded: a handler cancelled mid-exchange must not leave the next one its answer (the
        # exchange runs to its end; its outcome is then dropped, not logged as never retrieved).
        exchange = asyncio.ensure_future(self._exchange(self._encoder.encode(job)))
        exchange.add_done_callback(lambda task: task.cancelled() or task.exception())
        reply = await asyncio.shield(exchange)
        if isinstance(reply, Refused):
            raise ServeError(reply.status, reply.message, reply.param)
        if not isinstance(reply, Decoded):
            raise ServeError(500, f"the body-parsing process answered {type(reply).__name__}")
        return reply

    async def _exchange(self, job: bytes) -> Answer:
        async with self._turn:
            process = await self._running()
            try:
                return await asyncio.wait_for(self._ask(process, job), self.timeout_s)
            except asyncio.TimeoutError:
                await self._stop(kill=True)
                raise ServeError(413, f"the request body took longer than {self.timeout_s:g} s to parse") from None
            except (ConnectionError, asyncio.IncompleteReadError, msgspec.DecodeError):
                await self._stop(kill=True)
                raise ServeError(500, "the body-parsing process failed; it has been restarted") from None

    async def _ask(self, process: asyncio.subprocess.Process, job: bytes) -> Answer:
        assert process.stdin is not None  # started with pipes
        process.stdin.write(len(job).to_bytes(8, "big"))
        process.stdin.write(job)
        await process.stdin.drain()
        return await self._answer(process)

    async def _answer(self, process: asyncio.subprocess.Process) -> Answer:
        assert process.stdout is not None  # started with pipes
        size = int.from_bytes(await process.stdout.readexactly(8), "big")
        # Read into its place a chunk at a time: the loop never copies the whole answer at once
        # (a reader's buffer grown to tens of megabytes, then sliced, costs it 100 ms).
        frame = bytearray(size)
        view, got = memoryview(frame), 0
        while got < size:
            chunk = await process.stdout.read(min(size - got, READ_CHUNK))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", size)
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
        return self._decoder.decode(frame)

    async def _running(self) -> asyncio.subprocess.Process:
        if self.process is None or self.process.returncode is not None:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=READ_CHUNK)
            try:
                ready = await asyncio.wait_for(self._answer(self.process), self.timeout_s)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, msgspec.DecodeError):
                await self._stop(kill=True)
                raise ServeError(500, "the body-parsing process did not start") from None
            if not isinstance(ready, Ready):
                await self._stop(kill=True)
                raise ServeError(500, f"the body-parsing process began with {type(ready).__name__}")
        return self.process

    async def _stop(self, kill: bool) -> None:
        process, self.process = self.process, None
        if process is None or process.returncode is not None:
            return
        if kill:
            process.kill()
        else:
            assert process.stdin is not None  # started with pipes
            process.stdin.close()  # the process exits at the end of its stdin
        try:
            await asyncio.wait_for(process.wait(), 10)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()

    async def close(self) -> None:
        """Stop the process (it finishes the body it is on)."""
        with contextlib.suppress(Exception):
            async with self._turn:
                await self._stop(kill=False)
