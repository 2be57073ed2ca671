"""LMPool IPC: shared-memory rings carrying msgspec messages between processes.

A pool owner creates links; each end of a link is opened by name, in one process, as an
asyncio ``Channel``. ``Requester``/``Responder`` add request/response on a channel. This
package knows nothing of LLMs; the message types are its users'.

Parent (the pool owner)::

    pool = IpcPool.start()                 # also sweeps dead pools' leftovers
    link = pool.create_link()              # two 1 MiB rings, two semaphores
    child = subprocess.Popen([sys.executable, "-m", "worker", link.b])
    channel = Channel(link.a, ToParent)    # inside the running event loop
    channel.expect_peer(child.pid)         # fail, not hang, if it dies before opening
    await channel.send(Hello())
    reply = await channel.recv()
    ...
    channel.close()
    pool.close()                           # unlinks every segment and semaphore

Child::

    channel = Channel(sys.argv[1], ToChild)  # the end name is a plain string

A board publishes one value (say, a state snapshot) that any number of read-only readers
take without disturbing the writer::

    name = pool.create_board("state", capacity=65536)
    BoardWriter(name).publish(b"...")     # in one process
    BoardReader(name).read()              # in any other: the latest value, or None
"""

from .board import BoardBusyError, BoardReader, BoardWriter
from .channel import Channel, ChannelStats
from .errors import (
    ChannelClosedError,
    DecodeError,
    IpcError,
    LinkError,
    MessageError,
    MessageTooLargeError,
    PeerDeadError,
    RemoteError,
    RingCorruptError,
    SharedMemoryTooSmallError,
)
from .lifecycle import boards, pid_alive, remove_pool, sweep_dead_pools
from .pool import DEFAULT_CAPACITY, IpcPool, Link, close_on_sigterm
from .rpc import Requester, Responder

__all__ = [
    "BoardBusyError",
    "BoardReader",
    "BoardWriter",
    "DEFAULT_CAPACITY",
    "Channel",
    "ChannelClosedError",
    "ChannelStats",
    "DecodeError",
    "IpcError",
    "IpcPool",
    "Link",
    "LinkError",
    "MessageError",
    "MessageTooLargeError",
    "PeerDeadError",
    "RemoteError",
    "Requester",
    "Responder",
    "RingCorruptError",
    "SharedMemoryTooSmallError",
    "boards",
    "close_on_sigterm",
    "pid_alive",
    "remove_pool",
    "sweep_dead_pools",
]
