"""The skinny linear kernel (``kernels/skinny_linear.cu``: a decode step's 1-8 rows times a
weight, each weight read once) against fp64 sums of the same half inputs, and ``ops.cuda.linear``
sending 1-2 rows to it, 3-8 to its tensor-core kernel ``skinny_linear_mma`` and every other shape
to cuBLAS (needs a GPU).

The kernel sums in fp32 in its own order and rounds once, so its results are the exact sums
rounded, give or take a unit; freed allocator memory is NaN before each call, so an output it
forgets to write shows. Weights of a row count that is no multiple of the kernel's four rows a
block, inner sizes that are no multiple of its 128 threads' vectors, and a strided x (the rows of
a wider tensor, as a slice of the qkv projection would be) are among the cases.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmpool.ops import cuda
from tests.kernels.test_norm_rope_gpu import poisoned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HALVES = [torch.float16, torch.bfloat16]


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    assert out.shape == (x.shape[0], w.shape[0]) and out.dtype == x.dtype and out.is_contiguous()
    assert not torch.isnan(out).any(), "an output element was never written"
    ref = exact(x, w)
    ulp = 2.0 ** -(7 if out.dtype == torch.bfloat16 else 10)
    # fp32 sums of k products of values around 1 carry ~k * 2^-24 of error: far below a unit of
    # the output, whose scale is sqrt(k); one unit of rounding, and that error, allowed.
    bound = ulp * ref.abs() + 1e-5 * x.shape[1] ** 0.5
    assert ((out.double() - ref).abs() <= bound).all(), "more than a unit of rounding from the exact sum"


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (1001, 8), (7, 1000), (151936, 1024)])
def test_skinny_linear_is_the_exact_sum_rounded(dtype, rows, n, k):
    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + k)
    wide = torch.randn(rows, k + 64, generator=gen, device="cuda").to(dtype)
    x = wide[:, 64:]  # rows of a wider tensor: stride k + 64, 16-byte aligned at 64 elements in
    w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(dtype)
    poisoned()
    check(cuda.load_extension().skinny_linear(x, w), x, w)
    poisoned()
    check(cuda.linear(x, w), x, w)


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_a_weight_sliced_out_of_a_larger_one_is_read_by_its_own_row_stride(rows):
    """Rows of a wider weight, from an offset: the kernel steps by the weight's stride, not k."""
    k, n = 1024, 1001
    big = (torch.randn(n + 3, k + 64, device="cuda") / k**0.5).to(torch.bfloat16)
    w = big[3:, 32:32 + k]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    poisoned()
    check(cuda.load_extension().skinny_linear(x, w), x, w)


@pytest.mark.parametrize("case", ["nine_rows", "fp32", "unaligned", "odd_k", "three_dims_ten_rows"])
def test_linear_sends_what_the_kernel_does_not_take_to_cublas(case):
    """Each such input gives ``F.linear``'s own bits: the kernel never saw it."""
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    rows, k = (9 if case == "nine_rows" else 4), (1004 if case == "odd_k" else 1024)
    base = torch.randn(rows * k + 1, device="cuda").to(dtype)
    x = base[1:].view(rows, k) if case == "unaligned" else base[:-1].view(rows, k)
    if case == "three_dims_ten_rows":
        x = torch.randn(2, 5, k, device="cuda", dtype=dtype)
    w = torch.randn(384, k, device="cuda", dtype=dtype)
    out = cuda.linear(x, w)
    assert torch.equal(out, F.linear(x, w))
    if case != "three_dims_ten_rows":
        with pytest.raises(RuntimeError, match="skinny_linear takes"):
            cuda.load_extension().skinny_linear(x, w)


def test_three_dimensional_decode_rows_go_through_the_kernel_and_keep_their_shape():
    x = torch.randn(1, 3, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    out = cuda.linear(x, w)
    assert out.shape == (1, 3, 512)
    assert torch.equal(out[0], cuda.load_extension().skinny_linear_mma(x[0], w))


def test_skinny_linear_replays_in_a_cuda_graph_on_new_inputs():
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 1024, device="cuda", dtype=torch.bfloat16)
    cuda.linear(x, w)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda.linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    check(out, x, w)


@pytest.mark.parametrize("rows,n,kernel", [(1, 151936, "skinny_linear"), (2, 4096, "skinny_linear"),
                                           (3, 4096, "skinny_linear_mma"), (4, 151936, "skinny_linear_mma"),
                                           (8, 6144, "skinny_linear_mma")])
def test_linear_runs_the_skinny_kernel_at_one_or_two_rows_and_the_tensor_core_one_to_eight(rows, n, kernel):
    """The kernel benchmark's ``linear`` case: at 1-2 rows the skinny kernel won every projection,
    at 4 and 8 the tensor-core one won over a layer's and the LM head's (a CUDA graph pads 3 to 4
    and 5-7 to 8: neither kernel's bits change with it)."""
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, 1024, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(cuda.linear(x, w), getattr(cuda.load_extension(), kernel)(x, w))


@pytest.mark.parametrize("kernel", ["skinny_linear", "skinny_linear_mma"])
def test_a_row_s_result_does_not_depend_on_the_rows_beside_it(kernel):
    """A decode row gives the same bits in a step of 3 rows (eager) and one padded to 4 or 8
    (a CUDA graph's size): greedy tokens must not change with the batch's padding."""
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    run = getattr(cuda.load_extension(), kernel)
    alone = [run(x[i:i + 1], w) for i in range(8)]
    for rows in range(2, 9):
        together = run(x[:rows], w)
        assert all(torch.equal(together[i:i + 1], alone[i]) for i in range(rows)), f"{rows} rows"


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (1001, 8), (7, 1000), (1000, 1064)])
def test_the_tensor_core_kernel_is_the_exact_sum_rounded(dtype, rows, n, k):
    """``skinny_linear_mma``: tiles of 16 outputs (1001 and 7 are no multiple), chunks of 32 of k
    (8, 1000 and 1064 are none), from a strided x."""
    gen = torch.Generator(device="cuda").manual_seed(rows * 11 + k)
    x = torch.randn(rows, k + 64, generator=gen, device="cuda").to(dtype)[:, 64:]
    w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(dtype)
    poisoned()
    check(cuda.load_extension().skinny_linear_mma(x, w), x, w)

