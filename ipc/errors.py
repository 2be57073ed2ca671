"""Exceptions raised by the IPC transport.

Every error a caller can see derives from ``IpcError``; each one names what went wrong
and, where it helps, the peer process and sizes involved.
"""


class IpcError(Exception):
    """Base class of every error raised by ``lmpool_ipc``."""


class RingCorruptError(IpcError):
    """A ring's header or framing is not what this format writes (bad magic, version,
    or a frame length that runs past the published data). Framing is lost: fatal."""


class MessageTooLargeError(IpcError, ValueError):
    """A message does not fit in the ring even when the ring is empty."""


class DecodeError(IpcError, ValueError):
    """One frame could not be decoded into the channel's message type. The frame is
    consumed; the channel keeps working and the next call returns the next message."""


class PeerDeadError(IpcError, ConnectionError):
    """The process at the other end of a channel exited or missed its heartbeat."""


class ChannelClosedError(IpcError, ConnectionError):
    """This end, or the peer's end, of a channel was closed."""


class RemoteError(IpcError):
    """A request handler on the other end raised; the message carries its description."""
