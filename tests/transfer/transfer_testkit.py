"""What the transport tests and their peer processes share: deterministic KV caches and
block ids (so the test computes the bytes a peer must end up with), and a harness that
starts peers, talks to them line by line and always reaps them."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch

from lmpool.ops.reference import pack_kv, unpack_kv

HERE = Path(__file__).resolve().parent
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 64, 16, 160
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LINE_GUARD_S = 60  # turns a hang into a failure; never reached by a passing test


def make_cache(rank: int, incarnation: int = 0, dtype: str = "float32") -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank + 100 * incarnation)
    shape = (LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=g).to(DTYPES[dtype])


def block_ids(seed: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(source ids, destination ids) of one transfer: distinct, in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_BLOCKS, generator=g)[:count], torch.randperm(NUM_BLOCKS, generator=g)[:count]


def payload_like(count: int, dtype: str) -> torch.Tensor:
    return torch.empty(LAYERS, 2, count, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPES[dtype])


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def expected_cache(dst_rank: int, transfers: list[dict], dtype: str = "float32", incarnation: int = 0,
                   src_incarnations: dict[int, int] | None = None) -> str:
    """Digest of ``dst_rank``'s cache after unpacking ``transfers`` (each {src, blocks, seed}) in order."""
    cache = make_cache(dst_rank, incarnation, dtype)
    for t in transfers:
        src_ids, dst_ids = block_ids(t["seed"], t["blocks"])
        src_cache = make_cache(t["src"], (src_incarnations or {}).get(t["src"], 0), dtype)
        unpack_kv(cache, dst_ids, pack_kv(src_cache, src_ids))
    return digest(cache)


class Peer:
    """One peer process: ``python -m transfer_peer ADDRESS RANK WORLD SCRIPT``."""

    def __init__(self, address: str, rank: int, world_size: int, script: list, incarnation: int = 0,
                 dtype: str = "float32", **transport: object) -> None:
        header = {"incarnation": incarnation, "dtype": dtype, **transport}
        self.rank = rank
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "transfer_peer", address, str(rank), str(world_size),
             json.dumps(header), json.dumps(script)],
            cwd=HERE, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def line(self) -> dict:
        """The next JSON line the peer printed (fails if it exits or stays silent)."""
        try:
            line = self._lines.get(timeout=LINE_GUARD_S)
        except queue.Empty:
            raise AssertionError(f"rank {self.rank} printed nothing for {LINE_GUARD_S}s") from None
        if line is None:
            raise AssertionError(f"rank {self.rank} exited ({self.proc.wait()}) before printing a line")
        return json.loads(line)

    def expect(self, key: str) -> dict:
        msg = self.line()
        assert key in msg, f"rank {self.rank}: expected a {key!r} line, got {msg}"
        return msg

    def tell(self, text: str = "go") -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def finish(self) -> dict:
        """The peer's last line (``exit``), after which it must exit with status 0."""
        last = self.expect("exit")
        assert self.proc.wait(timeout=LINE_GUARD_S) == 0
        return last


def reap(peers: list[Peer]) -> list[int]:
    """Kill whatever is still running; return the pids that were."""
    alive = [p.proc.pid for p in peers if p.proc.poll() is None]
    for p in peers:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()
    return alive


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
