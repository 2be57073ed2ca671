"""The bookkeeping of one transfer plan, without processes or bytes (diagnostic, CPU).

Two block managers with their transfer participants and the control plane's coordinator
and page table run in this process; a chain of n blocks is moved back and forth, every
phase message delivered at once and every worker delta applied after each
acknowledgement, and the source's prepare acknowledgement (it carries every block's token
ids) is msgpack-encoded and decoded as the rings would. What the pool adds on top of this
figure is its processes' loops and rings; what it adds on top of those is the bytes.

    python -m tools.diagnostics.profile_plan_bookkeeping --block-size 256 --sizes 1,16,64
"""

from __future__ import annotations

import argparse
import random
import time

import msgspec

from lmpool.control.page_table.manager import GlobalBlockManager
from lmpool.engine.block_manager import BlockManager
from lmpool.engine.hashing import ROOT_HASH, chain_hashes
from lmpool.engine.sequence import Sequence
from lmpool.protocol import (
    SUCCESS,
    DestPrepared,
    Finalize,
    PlanState,
    PrepareDest,
    PrepareSource,
    Publish,
    SourcePrepared,
)
from lmpool.sampling_params import SamplingParams
from lmpool.control.transfers.coordinator import TransferCoordinator
from lmpool.dataplane.transactions import TransferParticipant


def answer(part: TransferParticipant, bm: BlockManager, rank: int, msg):
    """Carry out one order as a worker would, and answer it (the source's prepare answer
    crosses msgpack, as the rings carry it)."""
    if isinstance(msg, PrepareSource):
        local = part.prepare_source(msg.plan_id, msg.hashes, msg.generations)
        ack = SourcePrepared(msg.plan_id, rank, local.block_ids, local.token_ids)
        return msgspec.msgpack.decode(msgspec.msgpack.encode(ack), type=SourcePrepared)
    if isinstance(msg, PrepareDest):
        local = part.prepare_dest(msg.plan_id, msg.num_blocks)
        return DestPrepared(msg.plan_id, rank, local.block_ids, [bm.blocks[b].generation for b in local.block_ids])
    if isinstance(msg, Publish):
        part.publish(msg.plan_id, msg.hashes, msg.parents, msg.token_ids)
    elif isinstance(msg, Finalize):
        part.finalize(msg.plan_id, msg.move, msg.keep)
    else:
        part.executed(msg.plan_id)
    return SUCCESS[msg.phase](msg.plan_id, rank)


def seconds_per_move(n: int, block_size: int, reps: int, seed: int = 0) -> float:
    gbm = GlobalBlockManager(2, block_size)
    inbox: list = []
    coord = TransferCoordinator(gbm, lambda rank, msg: inbox.append((rank, msg)), phase_timeout_s=60.0)
    bms = [BlockManager(2 * n + 8, block_size) for _ in range(2)]
    parts = [TransferParticipant(bm, lease_s=60.0) for bm in bms]
    for rank, bm in enumerate(bms):
        gbm.register_rank(rank, 1, bm.num_blocks)
        gbm.apply_snapshot(rank, 1, bm.snapshot())
    rng = random.Random(seed)
    tokens = [rng.randrange(1000) for _ in range(n * block_size + 1)]
    seq = Sequence("s", tokens, SamplingParams(temperature=0, max_tokens=1), block_size)
    bm = bms[0]
    bm.admit(seq, bm.match_prefix(seq))  # cache the chain on rank 0, as a prefill would
    bm.grow(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)
    bm.free(seq)
    gbm.apply_delta(0, 1, bm.drain_delta())
    hashes = chain_hashes(tokens, block_size)
    parents = [ROOT_HASH] + hashes[:-1]
    src, dst = 0, 1
    start = time.perf_counter()
    for _ in range(reps):
        generations = [next(e for e in gbm.entries(h) if e.rank == src and e.ready).generation for h in hashes]
        plan = coord.start(src, dst, hashes, generations, parents, move=True)
        while inbox:
            rank, msg = inbox.pop(0)
            coord.on_ack(answer(parts[rank], bms[rank], rank, msg))
            for r, b in enumerate(bms):
                gbm.apply_delta(r, 1, b.drain_delta())
        if plan.state is not PlanState.DONE:
            raise RuntimeError(f"the move of {n} blocks ended {plan.state.value}: {plan.abort_reason}")
        src, dst = dst, src
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--sizes", default="1,16,64")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    for n in (int(s) for s in args.sizes.split(",")):
        print(f"{n:>4} blocks: {seconds_per_move(n, args.block_size, args.reps) * 1e3:.3f} ms per move")


if __name__ == "__main__":
    main()
