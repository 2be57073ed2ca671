"""Exceptions raised by the IPC transport.

Every error a caller can see derives from ``IpcError``; each one names what went wrong
and, where it helps, the peer process and sizes involved. Two families matter to a
caller deciding what failed:

- ``MessageError`` (also a ``ValueError``): one message was refused or did not decode.
  The link is intact and the next message goes through; the failure belongs to that
  message (and the request it carried), never to the peer.
- ``LinkError`` (also a ``ConnectionError``): the link itself is gone or unusable (the
  peer died or closed, or the ring's framing is lost). Only this means the peer is lost.
"""


class IpcError(Exception):
    """Base class of every error raised by ``lmpool_ipc``."""


class MessageError(IpcError, ValueError):
    """One message failed (too large, or not decodable); the link keeps working."""


class LinkError(IpcError, ConnectionError):
    """The link failed: nothing more will pass on it."""


class RingCorruptError(LinkError):
    """A ring's header or framing is not what this format writes (bad magic, version,
    or a frame length that runs past the published data). Framing is lost: fatal."""


class MessageTooLargeError(MessageError):
    """A message does not fit in the ring even when the ring is empty. Nothing was sent."""


class DecodeError(MessageError):
    """One frame could not be decoded into the channel's message type. The frame is
    consumed; the channel keeps working and the next call returns the next message."""


class PeerDeadError(LinkError):
    """The process at the other end of a channel exited or missed its heartbeat."""


class ChannelClosedError(LinkError):
    """This end, or the peer's end, of a channel was closed."""


class SharedMemoryTooSmallError(IpcError):
    """The pool's rings would not fit the shared-memory filesystem whole. Its pages are taken as
    a ring first writes them, so such a pool would start, then die of SIGBUS once full."""


class RemoteError(IpcError):
    """A request handler on the other end raised; the message carries its description."""
