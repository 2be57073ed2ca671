"""A worker's side of the transport tests: ``python -m transfer_peer ADDRESS RANK WORLD
HEADER SCRIPT``.

It runs SCRIPT (a JSON list of steps) against the transport HEADER names (``kind``: gloo,
nccl (``lanes``: communicators per direction), or cuda_ipc on ``device``, or on cuda:RANK
with ``device_per_rank``; ``share_cache``:
cuda_ipc exports the cache for pulls) and prints one JSON line per result. Steps (one key names each):
  {"connect": peer, "session": s}           gloo: start connecting
  {"connected": timeout}                    gloo: wait for every connection started so far
  {"export": null}                          cuda_ipc: print this rank's export (msgpack, hex)
  {"import": null}                          cuda_ipc: read a peer's export from stdin, connect
  {"send"|"recv": peer, "tag": t, "blocks": n, "seed": s}
                                            start one transfer of n blocks (ids from seed);
                                            sends pack this rank's cache, receives unpack
                                            into it once complete
  {"pull": peer, "blocks": n, "seed": s}    cuda_ipc: start copying n blocks of the peer's
                                            cache (source ids from seed) into this rank's
                                            (destination ids from seed); a refusal prints
                                            {"refused": seed, ...}
  {"wait": timeout}                         wait for every started transfer, print its
                                            digest, then the digest of the whole cache
  {"fail": timeout}                         wait for every started transfer, expecting each
                                            to raise; print the error and how long it took
  {"say": text} / {"hear": null}            print a line / read one from stdin (sequencing)
At the end it closes the transport and prints {"exit": ...} with the threads left.
"""

import json
import sys
import threading
import time

import msgspec
import torch

from lmpool.ops.reference import pack_kv, unpack_kv
from lmpool.dataplane import GlooTransport, TransportError
from lmpool.protocol.cuda_ipc import CudaIpcExport
from transfer_testkit import block_ids, digest, make_cache, payload_like


def out(**line) -> None:
    print(json.dumps(line), flush=True)


def main() -> None:
    address, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    header, script = json.loads(sys.argv[4]), json.loads(sys.argv[5])
    dtype = header["dtype"]
    device = torch.device(header.get("device", "cpu"))
    timeout_s = header.get("timeout_s", 20.0)
    if header.get("kind", "gloo") == "gloo":
        transport = GlooTransport(address, rank, world, timeout_s=timeout_s)
    elif header["kind"] == "nccl":
        from lmpool.dataplane.nccl import NcclTransport

        device = torch.device(f"cuda:{rank}")  # one GPU per rank: NCCL refuses two ranks on one
        torch.cuda.set_device(device)
        transport = NcclTransport(address, rank, world, device=str(device), timeout_s=timeout_s,
                                  **({"lanes": header["lanes"]} if "lanes" in header else {}))
    else:
        from lmpool.dataplane.cuda_ipc import CudaIpcTransport

        if header.get("device_per_rank"):
            device = torch.device(f"cuda:{rank}")
        torch.cuda.set_device(device)
    cache = make_cache(rank, header["incarnation"], dtype).to(device)
    if header.get("kind") == "cuda_ipc":
        transport = CudaIpcTransport(address, rank, world, device=str(device),
                                     staging_bytes=header.get("staging_bytes", 0), timeout_s=timeout_s,
                                     kv_cache=cache if header.get("share_cache") else None)
    connects, started = [], []
    for step in script:
        if "connect" in step:
            connects.append(transport.connect(step["connect"], step["session"]))
        elif "connected" in step:
            for h in connects:
                h.wait(step["connected"])
            connects.clear()
            out(connected=rank)
        elif "export" in step:
            out(export=msgspec.msgpack.encode(transport.export()).hex())
        elif "import" in step:
            export = msgspec.msgpack.decode(bytes.fromhex(sys.stdin.readline().strip()), type=CudaIpcExport)
            transport.connect(export)
            out(connected=rank)
        elif "send" in step or "recv" in step:
            op = "send" if "send" in step else "recv"
            src_ids, dst_ids = block_ids(step["seed"], step["blocks"])
            if op == "send":
                data = pack_kv(cache, src_ids)
                handle = transport.send(step["send"], data, step["tag"])
            else:
                data = payload_like(step["blocks"], dtype).to(device)
                handle = transport.recv(step["recv"], data, step["tag"])
            started.append((op, step, handle, data, dst_ids))
        elif "pull" in step:
            src_ids, dst_ids = block_ids(step["seed"], step["blocks"])
            try:
                handle = transport.pull(step["pull"], src_ids.tolist(), dst_ids.tolist())
            except TransportError as e:  # refused before anything was read
                out(refused=step["seed"], error=type(e).__name__, message=str(e))
                continue
            started.append(("pull", step, handle, None, dst_ids))
        elif "wait" in step:
            for op, s, handle, data, dst_ids in started:
                handle.wait(step["wait"])
                if op == "recv":
                    unpack_kv(cache, dst_ids, data)
                    out(received=s["tag"], digest=digest(pack_kv(cache, dst_ids)))
                elif op == "pull":
                    out(pulled=s["seed"], digest=digest(pack_kv(cache, dst_ids.to(device))))
                else:
                    out(sent=s["tag"])
            started.clear()
            out(cache=digest(cache))
        elif "fail" in step:
            for op, s, handle, _, _ in started:
                t0 = time.monotonic()
                try:
                    handle.wait(step["fail"])
                except TransportError as e:
                    out(failed=s.get("tag"), op=op, error=type(e).__name__, message=str(e),
                        elapsed=time.monotonic() - t0)
                else:
                    out(failed=s.get("tag"), op=op, error=None, elapsed=time.monotonic() - t0)
            started.clear()
        elif "say" in step:
            out(say=step["say"])
        elif "hear" in step:
            sys.stdin.readline()
        else:
            raise ValueError(f"unknown step {step}")
    transport.close()
    pending = transport.pending() if hasattr(transport, "pending") else 0
    out(exit=rank, pending=pending, threads=threading.active_count())


if __name__ == "__main__":
    torch.set_num_threads(1)  # several peers share two cores
    main()
