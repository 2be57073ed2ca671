"""Request/response over a channel, matched by correlation id.

On the wire every request and reply is a msgpack array ``[id, status, body]``: ``id`` is
chosen by the requester (unique among its requests in flight), ``status`` is ``OK`` or
``FAILED`` (then ``body`` is the handler's error as a string). A ``Requester`` owns the
receiving side of its channel: one reader task routes each reply to the future of the
request with that id, so concurrent callers never see each other's replies, whatever
order the replies come back in. A ``Responder`` answers each request in its own task.

The envelope is decoded first with the body left raw, so that a reply whose body does
not match the expected type fails only its own request (with ``DecodeError``), and a
reply too large for the ring fails its request (``RemoteError`` naming the sizes), not the
link.
"""

import asyncio
import itertools
from typing import Any, Awaitable, Callable, Generic, TypeVar

import msgspec

from .channel import Channel
from .errors import ChannelClosedError, DecodeError, IpcError, MessageTooLargeError, RemoteError

Q = TypeVar("Q")
R = TypeVar("R")

OK = 0
FAILED = 1

_envelope = msgspec.msgpack.Decoder(tuple[int, int, msgspec.Raw])
_error = msgspec.msgpack.Decoder(str)


class Requester(Generic[R]):
    """Sends requests on ``channel`` and returns their replies, decoded as ``reply_type``.
    The channel's receiving side belongs to the requester from now on."""

    def __init__(self, channel: Channel, reply_type: Any) -> None:
        self._channel = channel
        self._encoder = msgspec.msgpack.Encoder()
        self._reply_decoder = msgspec.msgpack.Decoder(reply_type)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._failure: IpcError | None = None
        self.stale_replies = 0  # replies to requests that were cancelled
        self.decode_errors = 0  # frames that were not an envelope at all

    async def request(self, body: Any) -> R:
        """Send ``body`` and return the reply to it. Raises ``RemoteError`` if the handler
        failed, ``DecodeError`` if the reply does not decode, or the channel's error if the
        peer dies or closes first."""
        if self._failure is not None:
            raise self._failure
        request_id = next(self._ids)
        reply = asyncio.get_running_loop().create_future()
        self._pending[request_id] = reply
        try:
            await self._channel.send_bytes(self._encoder.encode((request_id, OK, body)))
            if self._reader is None:
                self._reader = asyncio.create_task(self._read_replies())
            return await reply
        finally:
            self._pending.pop(request_id)

    async def _read_replies(self) -> None:
        try:
            while True:
                frame = await self._channel.recv_bytes()
                try:
                    request_id, status, body = _envelope.decode(frame)
                except msgspec.DecodeError:
                    self.decode_errors += 1  # no id to route it to
                    continue
                reply = self._pending.get(request_id)
                if reply is None or reply.done():
                    self.stale_replies += 1
                    continue
                try:
                    if status == OK:
                        reply.set_result(self._reply_decoder.decode(body))
                    else:
                        reply.set_exception(RemoteError(_error.decode(body)))
                except msgspec.DecodeError as e:
                    reply.set_exception(DecodeError(f"reply to request {request_id}: {e}"))
        except IpcError as e:
            self._failure = e
            for reply in self._pending.values():
                if not reply.done():
                    reply.set_exception(e)

    def close(self) -> None:
        """Stop reading replies; requests in flight fail with ``ChannelClosedError``. The
        channel itself stays open (its owner closes it)."""
        if self._reader is not None:
            self._reader.cancel()
        self._failure = ChannelClosedError("requester closed")
        for reply in self._pending.values():
            if not reply.done():
                reply.set_exception(self._failure)


class Responder(Generic[Q]):
    """Answers requests from ``channel``, decoded as ``request_type``, with ``handler``.
    Each request runs in its own task, so replies go back in completion order.

    ``after_reply`` (optional) runs once each reply is written, or could not be: work the
    requester need not wait for. It runs in the replying task with no await between the write
    and it, so nothing else on the loop runs in between (a frame is written without yielding)."""

    def __init__(
        self,
        channel: Channel,
        request_type: Any,
        handler: Callable[[Q], Awaitable[Any]],
        after_reply: Callable[[], None] | None = None,
    ) -> None:
        self._channel = channel
        self._encoder = msgspec.msgpack.Encoder()
        self._request_decoder = msgspec.msgpack.Decoder(request_type)
        self._handler = handler
        self._after_reply = after_reply
        self._tasks: set[asyncio.Task] = set()
        self.decode_errors = 0  # frames that were not an envelope at all

    async def serve(self) -> None:
        """Answer requests until the peer closes the channel (then return). A dead peer
        raises ``PeerDeadError``."""
        try:
            while True:
                try:
                    frame = await self._channel.recv_bytes()
                except ChannelClosedError:
                    return
                try:
                    request_id, _, body = _envelope.decode(frame)
                except msgspec.DecodeError:
                    self.decode_errors += 1
                    continue
                task = asyncio.create_task(self._answer(request_id, body))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            for task in self._tasks:
                task.cancel()

    async def _answer(self, request_id: int, body: msgspec.Raw) -> None:
        try:
            reply = (request_id, OK, await self._handler(self._request_decoder.decode(body)))
            frame = self._encoder.encode(reply)
        except Exception as e:
            frame = self._failure(request_id, e)
        try:
            try:
                await self._channel.send_bytes(frame)
            except MessageTooLargeError as e:  # the reply fails, not the link: say so instead
                await self._channel.send_bytes(self._failure(request_id, e))
        except ChannelClosedError:
            pass  # the requester is gone; nobody is waiting for this reply
        finally:
            if self._after_reply is not None:
                self._after_reply()

    def _failure(self, request_id: int, error: Exception) -> bytes:
        return self._encoder.encode((request_id, FAILED, f"{type(error).__name__}: {error}"))
