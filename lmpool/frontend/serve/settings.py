"""What ``lmpool serve`` was asked for; importable without the serve extra (the command line
reads its arguments into it before FastAPI is needed).

``HttpLimits`` holds every bound the server puts on a client: its defaults are the command
line's defaults, and ``server.uvicorn_config`` and the app read them from here only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 1024 * 1024


@dataclass(frozen=True)
class HttpLimits:
    """How much a client may send, and how slowly; what the server holds at once."""

    # The largest request body. A 1M-token prompt, the longest context Qwen3 models are extended
    # to, is about 8 MB as JSON token ids (ids below 151,936: six digits, a comma and a space)
    # and 4-9 MB as text (about 4 bytes a token in ASCII; a CJK character, about 1.5 a token,
    # is 6 bytes as the \uXXXX escape Python's json writes): 32 MiB holds any of them with room
    # for a long conversation's framing, and bounds what one request makes the server buffer.
    # A fixed figure rather than one derived from the context: the context is known only once
    # the pool has started, after the command line is read.
    max_request_bytes: int = 32 * MiB
    # Bodies up to this size are decoded and validated on the event loop (at most a few
    # milliseconds, whatever they hold); larger ones in the body-parsing process (``body_parser``).
    inline_parse_bytes: int = 64 * 1024
    # A body that the parsing process has not decoded within this is refused (413), and the
    # process restarted: a 32 MiB body takes it a few seconds at most.
    parse_timeout_s: float = 30.0
    # The request line and headers together. h11 (uvicorn's other parser) and Node allow 16 KiB;
    # 32 KiB leaves room for long bearer tokens and the headers gateways add.
    max_header_bytes: int = 32 * 1024
    # A request's line and headers must arrive within this of the connection opening (or, on a
    # kept-alive connection, of the request's first byte); its body within the next deadline
    # of the headers' end. uvicorn has neither: a client that sends a byte now and then holds a
    # connection for good. Ten seconds is ample for headers from any working network; a
    # minute lets a 32 MiB body through at about 0.5 MB/s.
    timeout_request_headers_s: float = 10.0
    timeout_request_body_s: float = 60.0
    # An idle kept-alive connection is closed after this: uvicorn's default and vLLM's, which
    # the clients and gateways written against vLLM expect.
    timeout_keep_alive_s: float = 5.0
    # Connections and requests at once: past it uvicorn answers new requests with a 503. Far
    # above what a pool serves at once (the pool queues what its replicas cannot run), it bounds
    # the tasks and buffered bodies a runaway client can pile up. None: no limit.
    limit_concurrency: int | None = 4096
    # Connections the kernel queues before the server accepts them (uvicorn's default; the
    # kernel caps it at net.core.somaxconn).
    backlog: int = 2048


@dataclass
class ServeSettings:
    """The model, its public name, the optional API key, the pool's arguments, the HTTP limits and
    whether to answer vLLM's ``/version``."""

    model: str
    served_model_name: str | None = None
    api_key: str | None = None
    pool_args: dict = field(default_factory=dict)
    limits: HttpLimits = field(default_factory=HttpLimits)
    version_route: bool = False  # answer vLLM's GET /version (``ecosystem`` says why it is off by default)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model
