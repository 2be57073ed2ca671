"""Control-plane messages that set up CUDA IPC connections; the control process relays
them between workers. No KV bytes travel here, and nothing here is ever unpickled: every
field is an int, a bool, a string or opaque bytes, decoded and type-checked by msgspec.

- ``CudaIpcExport`` (worker -> control -> worker ``peer``): what ``peer`` needs to map
  this worker's KV cache (for pulls) and staging buffer and events (for packed sends),
  and to tell whether this worker is still alive. The control plane forwards it to
  ``peer`` unchanged; it never opens the handles. Each export serves exactly one peer:
  the importer's release of a mapping decrements a counter that the export created.
"""

from __future__ import annotations

from lmpool.protocol.base import Message


class IpcStorage(Message):
    """``UntypedStorage._share_cuda_()`` of one CUDA storage, field by field."""

    handle: bytes  # the allocator's IPC handle of the allocation holding the storage
    nbytes: int
    offset: int  # of the storage in that allocation
    ref_counter_handle: bytes  # shared-memory file of the exporter's IPC reference counters
    ref_counter_offset: int
    event_handle: bytes  # orders the importer after the storage's allocation
    event_sync_required: bool


class CudaIpcExport(Message, tag="cuda_ipc_export"):
    rank: int  # the exporting worker
    peer: int  # the one worker this export is for: the control plane relays it there
    session: int  # the exporting transport's incarnation: names its keys in the rendezvous
    pid: int  # so the importer can tell that the exporter died ...
    pid_start: int  # ... and was not replaced by a process reusing its pid (0: unknown)
    device: int  # CUDA device index of the exporter's memory
    pair_session: int = 0  # the control plane's session for this pair (its connect order's)
    staging: IpcStorage | None = None  # the staging buffer of packed sends, if any
    events: list[bytes] = []  # IPC handles of the exporter's per-send "payload staged" events
    kv_cache: IpcStorage | None = None  # the KV cache pulls read from, if shared
    kv_shape: list[int] = []  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    kv_dtype: str = ""  # "bfloat16", "float16" or "float32"
