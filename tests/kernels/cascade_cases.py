"""Decode batches whose rows share cached prefixes, laid out as ``cascade_decode_attention`` takes
them: the CPU reference test and the GPU kernel test build theirs here."""

from __future__ import annotations

from typing import NamedTuple

import torch


class CascadeCase(NamedTuple):
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    kv_start: torch.Tensor
    prefix_tables: torch.Tensor
    prefix_lens: torch.Tensor
    prefix_starts: torch.Tensor
    prefix_rows: torch.Tensor

    def cascade_args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.kv_start,
                self.prefix_tables, self.prefix_lens, self.prefix_starts, self.prefix_rows)


def cascade_case(groups: list[tuple[int, list[int]]], block_size: int, q_heads: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, gen: torch.Generator, device: str = "cpu") -> CascadeCase:
    """``groups``: for each, its shared prefix in blocks and its rows' own keys after it (each at
    least 1); a group of no blocks is rows that share nothing, in no group of the cascade. The
    rows of all groups are shuffled in the batch; every block holds its own random keys, slots no
    sequence fills are NaN (a read of one shows), and block-table entries past a row's blocks
    name real blocks."""
    rows = [(g, suffix) for g, (_, suffixes) in enumerate(groups) for suffix in suffixes]
    order = torch.randperm(len(rows), generator=gen).tolist()  # batch row i is rows[order[i]]
    prefix_blocks = [blocks for blocks, _ in groups]
    suffix_blocks = [-(-suffix // block_size) for _, suffix in rows]
    num_blocks = sum(prefix_blocks) + sum(suffix_blocks) + 2
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))

    def fill(blocks: list[int], tokens: int) -> None:
        for i, block in enumerate(blocks):
            n = min(block_size, tokens - i * block_size)
            k_cache[block, :n] = torch.randn(n, kv_heads, head_dim, generator=gen)
            v_cache[block, :n] = torch.randn(n, kv_heads, head_dim, generator=gen)

    shared = []
    for blocks in prefix_blocks:
        shared.append([ids.pop() for _ in range(blocks)])
        fill(shared[-1], blocks * block_size)
    own = []
    for (_, suffix), blocks in zip(rows, suffix_blocks):
        own.append([ids.pop() for _ in range(blocks)])
        fill(own[-1], suffix)
    width = max(len(shared[g]) + len(own[r]) for r, (g, _) in enumerate(rows)) + 1
    tables = torch.randint(0, num_blocks, (len(rows), width), generator=gen, dtype=torch.int32)
    shared_groups = [g for g, blocks in enumerate(prefix_blocks) if blocks]
    prefix_width = max(1, max(prefix_blocks))
    prefix_tables = torch.randint(0, num_blocks, (len(shared_groups), prefix_width), generator=gen,
                                  dtype=torch.int32)
    context_lens, kv_start = [], []
    members: list[list[int]] = [[] for _ in groups]
    for i, r in enumerate(order):
        g, suffix = rows[r]
        blocks = shared[g] + own[r]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        context_lens.append(len(shared[g]) * block_size + suffix)
        kv_start.append(len(shared[g]) * block_size)
        members[g].append(i)
    for i, g in enumerate(shared_groups):
        prefix_tables[i, : len(shared[g])] = torch.tensor(shared[g], dtype=torch.int32)
    starts = [0]
    for g in shared_groups:
        starts.append(starts[-1] + len(members[g]))

    def on(t: torch.Tensor) -> torch.Tensor:
        return t.to(device)

    def ints(values: list[int]) -> torch.Tensor:
        return on(torch.tensor(values, dtype=torch.int32))

    q = torch.randn(len(rows), q_heads, head_dim, generator=gen)
    return CascadeCase(on(q.to(dtype)), on(k_cache.to(dtype)), on(v_cache.to(dtype)), on(tables), ints(context_lens),
                       ints(kv_start), on(prefix_tables), ints([prefix_blocks[g] * block_size for g in shared_groups]),
                       ints(starts), ints([i for g in shared_groups for i in members[g]]))
