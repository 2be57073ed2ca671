"""The decode path's kernels started early (programmatic dependent launch, ``launchers.h``): each
waits on the device for the kernel ahead of it, so a chain of them gives the same bits as plain
launches, eagerly and replayed from a CUDA graph on new inputs, and an engine's greedy tokens do
not change (needs a GPU; on one older than compute capability 9.0 the setting stays off)."""

from __future__ import annotations

import pytest
import torch

from lmpool import LLM, SamplingParams
from lmpool.ops import cuda

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
DIM, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 1024, 16, 8, 128, 16


@pytest.fixture
def ext():
    ext = cuda.load_extension()
    yield ext
    ext.set_dependent_launch(False)


def test_the_setting_is_on_only_where_the_device_has_it(ext):
    assert ext.set_dependent_launch(True) is HOPPER
    assert ext.set_dependent_launch(False) is False


class Chain:
    """One decode layer's kernels in a row, each reading the one before: norm, projections
    (the skinny kernel at these rows), rotary and KV store, split attention and its merge,
    SiLU x up, and the residual add's norm."""

    def __init__(self, rows: int):
        g = torch.Generator(device="cuda").manual_seed(rows)

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

        self.rows = rows
        self.norm = rand(DIM, scale=0.1) + 1
        self.qkv = rand((HEADS + 2 * KV_HEADS) * HEAD_DIM, DIM, scale=DIM ** -0.5)
        self.o = rand(DIM, HEADS * HEAD_DIM, scale=(HEADS * HEAD_DIM) ** -0.5)
        self.gate_up = rand(2 * 3072, DIM, scale=DIM ** -0.5)
        self.down = rand(DIM, 3072, scale=3072 ** -0.5)
        self.q_norm, self.k_norm = rand(HEAD_DIM, scale=0.1) + 1, rand(HEAD_DIM, scale=0.1) + 1
        blocks = rows * 40
        self.k_cache = rand(blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.v_cache = rand(blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.tables = torch.randperm(blocks, generator=g, device="cuda").view(rows, 40).to(torch.int32)
        self.lens = torch.randint(300, 40 * BLOCK, (rows,), generator=g, device="cuda").to(torch.int32)
        positions = torch.arange(40 * BLOCK, device="cuda", dtype=torch.float32)
        angles = positions[:, None] / 10000 ** (torch.arange(0, HEAD_DIM, 2, device="cuda") / HEAD_DIM)
        self.cos, self.sin = angles.cos().contiguous(), angles.sin().contiguous()
        self.positions = (self.lens - 1).to(torch.int64)
        row = torch.arange(rows, device="cuda")
        self.slots = (self.tables[row, self.positions // BLOCK].to(torch.int64) * BLOCK + self.positions % BLOCK)

    def inputs(self, seed: int) -> torch.Tensor:
        g = torch.Generator(device="cuda").manual_seed(1000 + seed)
        return torch.randn(self.rows, DIM, generator=g, device="cuda").to(torch.bfloat16)

    def __call__(self, ext, x: torch.Tensor) -> torch.Tensor:
        h = ext.rms_norm(x, self.norm, 1e-6)
        q = ext.qkv_norm_rope_store(ext.linear(h, self.qkv), self.q_norm, self.k_norm, 1e-6, self.cos, self.sin,
                                    self.positions, self.k_cache, self.v_cache, self.slots, HEADS)
        attended = ext.paged_decode_attention(q, self.k_cache, self.v_cache, self.tables, self.lens,
                                              HEAD_DIM ** -0.5, 4)
        h, residual = ext.add_rms_norm(ext.linear(attended.view(self.rows, -1), self.o), x, self.norm, 1e-6)
        return ext.linear(ext.silu_mul(ext.linear(h, self.gate_up)), self.down) + residual


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_a_chain_started_early_gives_the_plain_launches_bits(ext, rows):
    chain = Chain(rows)
    ext.set_dependent_launch(False)
    want = [chain(ext, chain.inputs(i)) for i in range(6)]
    ext.set_dependent_launch(True)
    eager = [chain(ext, chain.inputs(i)) for i in range(6)]
    static = chain.inputs(0)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(ext, static)  # warm-up on a side stream, as capture asks
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = chain(ext, static)
    replayed = []
    for i in range(6):
        static.copy_(chain.inputs(i))
        graph.replay()
        replayed.append(out.clone())
    assert all(torch.equal(a, b) for a, b in zip(eager, want)), "eager, started early"
    assert all(torch.equal(a, b) for a, b in zip(replayed, want)), "a CUDA graph, started early"


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_an_engine_started_early_decodes_the_same_greedy_tokens(tiny_model, enforce_eager):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 90, (12,), generator=g)
    prompts = [torch.randint(0, 1000, (int(k),), generator=g).tolist() for k in lengths]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens = {}
    try:
        for early in (False, True):
            with LLM(tiny_model, device="cuda", dtype="bfloat16", block_size=BLOCK, enforce_eager=enforce_eager,
                     dependent_launch=early) as llm:
                tokens[early] = [o.token_ids for o in llm.generate(prompts, greedy)]
    finally:
        cuda.load_extension().set_dependent_launch(False)
    assert tokens[True] == tokens[False]
