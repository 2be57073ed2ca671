"""uvicorn's HTTP/1.1 protocol (httptools) with deadlines for a client to send its request, and a
cap on the request's head.

uvicorn times out only idle kept-alive connections, and httptools buffers a request head of
any size: a client that sends a byte now and then holds a connection (a socket, a parser, its
buffers) for as long as it likes; a red-team run held 2,000 that way for 40 s. This protocol adds:

- a head deadline: a request's line and headers must arrive within ``timeout_request_headers_s``
  of the connection opening, or, on a kept-alive connection, of the request's first byte;
- a body deadline: its body within ``timeout_request_body_s`` of the head's end;
- a head cap: at most ``max_header_bytes`` of line and headers (give or take one read);
- a cap on what is dropped: once a request is answered, uvicorn drops the rest of its body as it
  comes (the app refused it unread: a 413, a 401...); past twice ``max_request_bytes`` of that,
  the connection is closed, rather than a client's endless body read and dropped.

Past either deadline the client gets a 408, past the head cap a 431 (OpenAI-style bodies), and
the connection is closed. A deadline counts only time the client is to blame for: one that expires
while uvicorn has paused reading the connection (its flow control, a pipelined request waiting
for its turn) or while a response is being sent on it starts again. Once a response to the
request has begun, there is no 408 to send: the connection is just closed.

It subclasses uvicorn's ``HttpToolsProtocol`` and relies on its parser callbacks and its
``cycle``, ``flow`` and ``transport`` attributes (``tests/serve/test_http_limits.py`` drives them).
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lmpool.frontend.serve.errors import error_body
from lmpool.frontend.serve.settings import HttpLimits


def limited_protocol(limits: HttpLimits) -> type[HttpToolsProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, holding ``limits``."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits: HttpLimits = HttpLimits()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        # Between a message's end (or the connection's start) and the next head's end: what
        # arrives is a request head, counted (a read that ends one message and begins the next
        # goes uncounted: the cap holds give or take one read).
        self._in_head = True
        self._head_bytes = 0
        self._dropped = 0  # body bytes of the current request that came after its response

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(self.limits.timeout_request_headers_s, "its request headers")

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.limits.max_header_bytes and not self.transport.is_closing():
            self._refuse(431, f"the request line and headers are larger than the {self.limits.max_header_bytes}-byte "
                              f"limit")

    # Parser callbacks (uvicorn's, each extended).
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._dropped = 0
        if self._deadline is None:  # a kept-alive connection's next request
            self._arm(self.limits.timeout_request_headers_s, "its request headers")

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_head, self._head_bytes = False, 0
        super().on_headers_complete()
        self._arm(self.limits.timeout_request_body_s, "its request body")  # on_message_complete disarms it

    def on_body(self, body: bytes) -> None:
        if self.cycle is not None and self.cycle.response_complete:  # uvicorn drops it
            self._dropped += len(body)
            if self._dropped > 2 * self.limits.max_request_bytes and not self.transport.is_closing():
                self._disarm()
                self.transport.close()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head = True
        super().on_message_complete()

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, seconds, what)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _responding(self) -> bool:
        cycle = self.cycle
        return cycle is not None and cycle.response_started and not cycle.response_complete

    def _expired(self, seconds: float, what: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused or self._responding():  # the server's delay, not the client's
            self._arm(seconds, what)
            return
        self._refuse(408, f"the client did not send {what} within {seconds:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` unless a response has begun, then close the connection."""
        self._disarm()
        cycle = self.cycle
        # In a head, ``cycle`` is the previous request's: its response may still be going out.
        begun = self._responding() if self._in_head else cycle is not None and cycle.response_started
        if not begun:
            body = json.dumps(error_body(status, message)).encode()
            head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
            self.transport.write(head.encode() + body)
        if cycle is not None and not cycle.response_complete:
            # The handler reading this request's body sees the client gone, and sends nothing more.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()
