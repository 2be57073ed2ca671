"""Control-plane messages that set up transport connections; the control process relays
them between workers. No KV bytes travel here, and nothing here is ever unpickled: every
field is an int, a bool or opaque bytes, decoded and type-checked by msgspec.

- ``ConnectPeer`` (control -> worker, sent to both ends of a pair): connect the gloo or
  nccl transport to ``peer`` under ``session``. The control plane picks a session never
  used before for that pair (a random 63-bit int), for the first connection and again
  after the pair broke or a worker restarted.
- ``CudaIpcExport`` (worker -> control -> one peer): what the peer needs to read this
  worker's staging buffer and wait on its events. Each export serves exactly one peer:
  the importer's release of the mapping decrements a counter that the export created.
"""

from __future__ import annotations

from lmpool.pool.messages import Message


class ConnectPeer(Message, tag="connect_peer"):
    peer: int
    session: int


class CudaIpcExport(Message, tag="cuda_ipc_export"):
    rank: int  # the exporting worker
    session: int  # its transport's incarnation: names its keys in the rendezvous
    pid: int  # so the importer can tell that the exporter died
    device: int  # CUDA device index of the staging buffer
    # ``UntypedStorage._share_cuda_()`` of the staging buffer, field by field:
    storage_handle: bytes  # the allocator's IPC handle of the allocation holding it
    storage_bytes: int
    storage_offset: int  # of the storage in that allocation
    ref_counter_handle: bytes  # shared-memory file of the exporter's IPC reference counters
    ref_counter_offset: int
    storage_event_handle: bytes  # orders the importer after the buffer's allocation
    storage_event_sync_required: bool
    events: list[bytes]  # IPC handles of the exporter's per-transfer "payload staged" events
