"""Prepare the real SGLang gateway (the ``smg_cache_aware`` peer, ``benchmarks/peers/eval_gateway.py``)
and the web stack of the ``lmpool serve`` hosts behind it for the device, which reaches no registry.

smg 1.13.0's wheel is 37 MB, most of it ``smg/smg_rs.abi3.so``; repacked as ``pack_dynamo`` repacks
Dynamo's (stripped, stored, x86-filtered xz) it is about 20 MB. ``smg launch`` runs the library
alone: grpcio, grpcio-health-checking and protobuf, which smg declares for its gRPC servicer, are
left out (the hosts serve HTTP here). So are the wheels ``.whl-dynamo`` brings (pydantic,
pydantic-core, annotated-types, pyzmq): one version of each in /tmp/site, where both install.

    python3 -m benchmarks.device.pack_serve            # writes .whl-serve/ (git-ignored)

``benchmarks/device/setup.sh`` unpacks and installs it into /tmp/site when ``.whl-serve/`` travels.
It is about 22 MiB: with the tracked tree (about 22 MiB) it cannot travel beside ``.whl-dynamo``
(about 39 MiB), so a run with both real routers takes two calls on one warm machine
(``PAPER_RUNBOOK.md``, "Every peer in one balanced run").
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.device import pack_dynamo

SMG = "smg==1.13.0"
LIBRARY = "smg/smg_rs.abi3.so"
# The hosts' serve extra and the driver's HTTP client, with what they need; smg's own needs but grpc.
WHEELS = ("fastapi", "uvicorn", "httptools", "prometheus-client", "httpx", "opentelemetry-api",
          "pyyaml", "setproctitle", "typing-extensions==4.16.0", "typing-inspection==0.4.5")
# Brought by .whl-dynamo at Dynamo's versions, or needed only by smg's gRPC servicer.
LEFT_OUT = ("pydantic-", "pydantic_core-", "annotated_types-", "pyzmq-", "grpcio", "protobuf-")


def main() -> int:
    out = pack_dynamo.fresh_folder(__doc__, ".whl-serve")
    with tempfile.TemporaryDirectory(prefix="pack-serve-") as tmp:
        pack_dynamo.download((SMG,), Path(tmp))
        [wheel] = Path(tmp).glob("smg-*.whl")
        packed = pack_dynamo.repack(wheel, out, Path(tmp), LIBRARY)
    pack_dynamo.download(WHEELS, out, needs=True)
    for f in out.iterdir():
        if f.name.startswith(LEFT_OUT):
            f.unlink()
    pack_dynamo.report(out, f"{packed.name} carries smg")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
