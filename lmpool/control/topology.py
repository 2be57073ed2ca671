"""Which replicas (ranks) sit on which GPU and which pairs share a direct NVLink.

Routing uses it twice: ``affinity(a, b)`` (2 same GPU, 1 direct NVLink
partners, 0 otherwise) breaks ties toward ranks close to the seed, and
``candidates(seed)`` restricts a route to the seed and its partners. Transfers
use the same pairs: only partners exchange KV blocks directly.

Invariants: ``affinity`` is symmetric; ``affinity(r, r) == 2``; two ranks on one
GPU are always partners; a rank is never its own partner. The object is
immutable after construction, so the routing hot path can read the
precomputed ``candidate_mask`` without copying.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence

SAME_GPU = 2
NVLINK = 1
NO_LINK = 0

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_GPU_NAME = re.compile(r"GPU(\d+)")
_NVLINK_CELL = re.compile(r"NV\d+")


class Topology:
    def __init__(self, world_size: int, gpu_of_rank: Sequence[int], links: Iterable[tuple[int, int]]) -> None:
        """Ranks ``0..world_size-1`` placed on ``gpu_of_rank``, with NVLink between the rank pairs ``links``."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if len(gpu_of_rank) != world_size:
            raise ValueError(f"gpu_of_rank has {len(gpu_of_rank)} entries for world_size {world_size}")
        self.world_size = world_size
        self.gpu_of_rank = tuple(gpu_of_rank)
        aff = [[SAME_GPU if self.gpu_of_rank[a] == self.gpu_of_rank[b] else NO_LINK for b in range(world_size)]
               for a in range(world_size)]
        for a, b in links:
            _check_pair(world_size, a, b)
            if aff[a][b] == NO_LINK:
                aff[a][b] = aff[b][a] = NVLINK
        self._affinity = tuple(tuple(row) for row in aff)
        self._partners = tuple(
            tuple(b for b in range(world_size) if b != a and aff[a][b] > NO_LINK) for a in range(world_size)
        )
        self.all_mask = (1 << world_size) - 1
        # Bit r set when rank r may serve a request seeded at this rank (itself and its partners).
        self._candidate_masks = tuple(
            (1 << a) | sum(1 << b for b in self._partners[a]) for a in range(world_size)
        )

    # ---- constructors --------------------------------------------------------------

    @classmethod
    def from_pairs(
        cls, world_size: int, pairs: Iterable[tuple[int, int]], gpu_of_rank: Sequence[int] | None = None
    ) -> Topology:
        """Explicit logical NVLink pairs between ranks; each rank its own GPU unless ``gpu_of_rank`` says otherwise."""
        return cls(world_size, list(range(world_size)) if gpu_of_rank is None else gpu_of_rank, pairs)

    @classmethod
    def virtual(cls, world_size: int) -> Topology:
        """CPU replicas: each rank its own "GPU", every rank a partner of every other (a full mesh)."""
        return cls(world_size, list(range(world_size)), _full_mesh(world_size))

    @classmethod
    def from_nvidia_smi(cls, text: str, gpu_of_rank: Sequence[int]) -> Topology:
        """Parse ``nvidia-smi topo -m`` output, keeping only NV# (NVLink) links between GPUs.

        PCIe and SMP paths (PIX, PXB, PHB, NODE, SYS) are not direct NVLink,
        so they give affinity 0. Two ranks on linked GPUs become partners.
        """
        gpus, links = _parse_topo_matrix(text)
        for rank, gpu in enumerate(gpu_of_rank):
            if gpu not in gpus:
                raise ValueError(f"rank {rank} is on GPU{gpu}, which the topology matrix does not list")
        rank_links = [
            (a, b)
            for a in range(len(gpu_of_rank))
            for b in range(a + 1, len(gpu_of_rank))
            if frozenset((gpu_of_rank[a], gpu_of_rank[b])) in links
        ]
        return cls(len(gpu_of_rank), gpu_of_rank, rank_links)

    @classmethod
    def detect(cls, world_size: int, device: str, gpu_of_rank: Sequence[int] | None = None) -> Topology:
        """The topology for ``world_size`` replicas on ``device`` ("cpu" or "cuda").

        On CUDA, ``nvidia-smi topo -m`` is the source when the tool is installed
        and answers; ranks go round robin over the GPUs it lists unless
        ``gpu_of_rank`` is given. Without it, nothing is known about links, so the
        ranks are treated as a full mesh (ranks that share a GPU still get
        affinity 2).
        """
        if not device.startswith("cuda"):
            return cls.virtual(world_size)
        text = _run_nvidia_smi()
        if text is not None:
            gpus, _ = _parse_topo_matrix(text)
            if gpu_of_rank is None:
                ordered = sorted(gpus)
                gpu_of_rank = [ordered[r % len(ordered)] for r in range(world_size)]
            return cls.from_nvidia_smi(text, gpu_of_rank)
        if gpu_of_rank is None:
            gpu_of_rank = list(range(world_size))
        return cls(world_size, gpu_of_rank, _full_mesh(world_size))

    # ---- queries -------------------------------------------------------------------

    def affinity(self, a: int, b: int) -> int:
        return self._affinity[a][b]

    def partners(self, rank: int) -> tuple[int, ...]:
        """Ranks other than ``rank`` that share its GPU or a direct NVLink with it."""
        return self._partners[rank]

    def candidates(self, seed: int | None) -> list[int]:
        """Ranks a request seeded at ``seed`` may go to: the seed and its partners (all ranks if None)."""
        mask = self.candidate_mask(seed)
        return [r for r in range(self.world_size) if mask >> r & 1]

    def candidate_mask(self, seed: int | None) -> int:
        """``candidates(seed)`` as a bitmask (bit r = rank r), for the routing hot path."""
        if seed is None:
            return self.all_mask
        if not 0 <= seed < self.world_size:
            raise ValueError(f"seed rank {seed} is out of range for world_size {self.world_size}")
        return self._candidate_masks[seed]

    def __repr__(self) -> str:
        pairs = [(a, b) for a in range(self.world_size) for b in self._partners[a] if a < b]
        return f"Topology(world_size={self.world_size}, gpu_of_rank={list(self.gpu_of_rank)}, partners={pairs})"


def _check_pair(world_size: int, a: int, b: int) -> None:
    if not (0 <= a < world_size and 0 <= b < world_size):
        raise ValueError(f"NVLink pair ({a}, {b}) names a rank outside 0..{world_size - 1}")
    if a == b:
        raise ValueError(f"NVLink pair ({a}, {b}) links a rank to itself")


def _full_mesh(world_size: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(world_size) for b in range(a + 1, world_size)]


def _parse_topo_matrix(text: str) -> tuple[set[int], set[frozenset[int]]]:
    """GPU indices and the NVLink-connected GPU pairs of a ``nvidia-smi topo -m`` matrix."""
    lines = [_ANSI_ESCAPE.sub("", line) for line in text.splitlines()]
    header: list[int] | None = None
    links: set[frozenset[int]] = set()
    rows: set[int] = set()
    for line in lines:
        cells = line.split()
        if not cells:
            continue
        if header is None:
            # The header is the first line whose leading cells are GPU0 GPU1 ...; the
            # non-GPU columns (NIC#, "CPU Affinity", ...) follow them.
            gpu_columns = []
            for cell in cells:
                match = _GPU_NAME.fullmatch(cell)
                if match is None:
                    break
                gpu_columns.append(int(match.group(1)))
            if gpu_columns:
                header = gpu_columns
            continue
        match = _GPU_NAME.fullmatch(cells[0])
        if match is None:
            continue  # NIC rows, the legend, blank lines
        gpu = int(match.group(1))
        values = cells[1 : 1 + len(header)]
        if len(values) < len(header):
            raise ValueError(f"topology row for GPU{gpu} has {len(values)} GPU cells, expected {len(header)}")
        rows.add(gpu)
        for peer, value in zip(header, values):
            if peer != gpu and _NVLINK_CELL.fullmatch(value):
                links.add(frozenset((gpu, peer)))
    if header is None:
        raise ValueError("no 'GPU0 GPU1 ...' header in the nvidia-smi topo -m output")
    if rows != set(header):
        raise ValueError(f"topology rows {sorted(rows)} do not match the header GPUs {header}")
    return set(header), links


def _run_nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None
