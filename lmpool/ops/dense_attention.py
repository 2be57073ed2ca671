"""One sequence's prefill attention over its keys and values gathered into one run, through
torch's dense attention (``scaled_dot_product_attention``, whose cuDNN kernels on Hopper ran
a long causal prompt at twice FlashAttention 2's varlen rate: ``results/kernels_NOTES.md``).

Dense attention aligns its causal mask top left, while a sequence's new queries end its
context. A context longer than its query therefore splits in two: the queries over the cached
prefix (every key visible; the query heads sharing a key head folded into one run of rows) and
over their own keys (causal), merged by each row's log-sum-exp of scores.

cuDNN builds a plan for each shape it sees, and a build cost 43-90 ms on an H200 (more than a
4k prompt's attention): every prompt of a new length paid it. Operands laid out as ``[S, H, d]``
(torch's BSHD) under ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` let torch (2.9 on) key its plans by
each length rounded up to a power of two (the lengths themselves go to cuDNN as ragged offsets),
so a process builds a few dozen plans, and ``warm`` builds them before the engine serves.
Torch reads the variable once, at the process's first cuDNN attention: ``usable`` and ``warm``,
this path's first calls, set it where the process has not (a process that ran cuDNN attention
before keeps a plan per length; one that set it off keeps it off, and ``warm`` then builds
nothing). Torch's plans are per thread: ``warm`` serves the thread that steps.

Invariants: the result equals ``reference.paged_attention`` on the same keys up to rounding
(``usable`` checks that on a small case before a device's first use, and answers False where
the kernels are missing or disagree, so the caller keeps its own path); no host sync outside
that check and ``warm``.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmpool.ops import reference

BUCKETED_PLANS = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"
_FUSED = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
_ANY = [*_FUSED, SDPBackend.MATH]


def one_sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` (``[n, q_heads, d]``, the last ``n`` positions of the context)
    over ``k`` and ``v`` (``[ctx, kv_heads, d]``, ``ctx >= n``): ``[n, q_heads, d]`` in ``q``'s dtype."""
    n, ctx = q.shape[0], k.shape[0]
    if ctx == n:
        # Fused kernels only on a GPU: the math fallback would hold every score ([heads, n, n]).
        with sdpa_kernel(_FUSED if q.is_cuda else _ANY):
            out = F.scaled_dot_product_attention(_bshd(q), _bshd(k), _bshd(v), is_causal=True, scale=scale,
                                                 enable_gqa=True)
        return out[0].transpose(0, 1)
    group = q.shape[1] // k.shape[1]
    prefix = ctx - n
    over_prefix, prefix_lse = _folded_attention(q, k[:prefix], v[:prefix], group, scale)
    own_k, own_v = (x[prefix:].repeat_interleave(group, dim=1) for x in (k, v))
    own, own_lse = attend_with_lse(_bshd(q), _bshd(own_k), _bshd(own_v), True, scale)
    return merge(over_prefix, prefix_lse, own[0].transpose(0, 1), own_lse[0].transpose(0, 1)).to(q.dtype)


def _folded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of ``q`` over ``k``, ``v`` with the ``group`` query heads of each key
    head as one run of ``n * group`` rows (no key copied per query head; row ``i * group + g`` is
    query ``i``'s head ``g`` of that key head): ``[n, q_heads, d]`` and the rows' log-sum-exps
    ``[n, q_heads]``."""
    n, q_heads, d = q.shape
    kv_heads = k.shape[1]
    rows = q.reshape(n, kv_heads, group, d).transpose(1, 2).reshape(n * group, kv_heads, d)
    out, lse = attend_with_lse(_bshd(rows), _bshd(k), _bshd(v), False, scale)
    out = out[0].transpose(0, 1).reshape(n, group, kv_heads, d).transpose(1, 2).reshape(n, q_heads, d)
    return out, lse[0].reshape(kv_heads, n, group).transpose(0, 1).reshape(n, q_heads)


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``[1, H, S, d]`` queries over ``[1, H, K, d]`` keys, top-left causal or
    unmasked, and each row's natural log-sum-exp of scaled scores ``[1, H, S]`` (fp32): cuDNN's
    on a GPU, fp32 math elsewhere."""
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        return out, lse.reshape(q.shape[:3]).float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        scores.masked_fill_(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype), lse


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Softmax attention over two disjoint key sets from each one's output and log-sum-exp
    (``[..., d]`` and ``[...]``): each weighted by its share of the rows' total, in fp32."""
    w1 = torch.sigmoid(lse1 - lse2)[..., None]  # e^l1 / (e^l1 + e^l2)
    return o2.float() + (o1.float() - o2.float()) * w1


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """``[S, H, d]`` as dense attention's ``[1, H, S, d]``, laid out as ``[S, H, d]`` (BSHD: what
    torch's plans keyed by rounded lengths take)."""
    return x.contiguous().unsqueeze(0).transpose(1, 2)


def bucketed_plans() -> bool:
    """Whether torch keys this path's cuDNN plans by length bucket: the variable set on, here
    where the process has not set it (torch reads it at its first cuDNN attention)."""
    return os.environ.setdefault(BUCKETED_PLANS, "1").strip().upper() in ("1", "ON", "YES", "TRUE", "Y")


def warm(device: torch.device, dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int,
         min_query: int, max_query: int, max_context: int) -> int:
    """Build the plans of every length bucket a step of one sequence may take on ``device``: its
    query of ``min_query`` to ``max_query`` tokens alone, and after a cached prefix of up to
    ``max_context`` less its query (from the 256-key bucket: a shorter one pays its build once);
    the calls made: none off a GPU, without bucketed plans (a plan per length is never warm), where
    no step's query can be that long, or where dense attention is not ``usable``. The queries are
    the smallest of their buckets and of their folded rows' (``query * group``, in buckets of
    their own where the group is no power of two), which costs the least."""
    if device.type != "cuda" or max_query < min_query or not bucketed_plans() or not usable(device):
        return 0
    scale, calls = head_dim**-0.5, 0
    for n in _warm_queries(min_query, max_query, q_heads // kv_heads):
        q = torch.zeros(n, q_heads, head_dim, dtype=dtype, device=device)
        for prefix in [0, *_bucket_starts(256, max(1, max_context - min_query))]:
            if prefix + n > max_context:  # no step reaches this bucket
                break
            k = torch.zeros(prefix + n, kv_heads, head_dim, dtype=dtype, device=device)
            one_sequence_attention(q, k, k, scale)
            calls += 1
    torch.cuda.synchronize(device)
    return calls


def _warm_queries(min_query: int, max_query: int, group: int) -> list[int]:
    """Query lengths from ``min_query`` to ``max_query`` that reach every bucket a query of that
    range takes, and every bucket its folded rows (``query * group``) take."""
    folded = {min(max_query, max(min_query, -(-rows // group)))
              for rows in _bucket_starts(min_query * group, max_query * group)}
    return sorted(set(_bucket_starts(min_query, max_query)) | folded)


def _bucket_starts(lo: int, hi: int) -> list[int]:
    """The smallest length of each power-of-two bucket (``(2^(j-1), 2^j]``) that lengths from
    ``lo`` to ``hi`` fall in."""
    top = max(lo, hi)
    starts, bound = [], 1 << max(0, lo - 1).bit_length()  # the bucket ``lo`` is in
    while True:
        starts.append(max(lo, bound // 2 + 1))
        if bound >= top:
            return starts
        bound *= 2


@functools.cache
def usable(device: torch.device) -> bool:
    """Whether ``one_sequence_attention`` runs on ``device`` and matches the reference there, for
    cold queries and ones after a cached prefix, GQA of 2, bf16 on a GPU: 96 queries over 0 and 96
    cached keys, then 80 over 0 and 100, whose lengths share those buckets, so their plans are
    the first ones run again at lengths they were not built at; checked once a device."""
    if device.type == "cuda":
        bucketed_plans()
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(96, 4, 64, generator=gen).to(device, dtype)
    k, v = (torch.randn(192, 2, 64, generator=gen).to(device, dtype) for _ in range(2))
    for n, prefix in ((96, 0), (96, 96), (80, 0), (80, 100)):
        keys, values = k[:prefix + n], v[:prefix + n]
        try:
            out = one_sequence_attention(q[:n], keys, values, 0.125)
        except (RuntimeError, NotImplementedError):  # no fused or cuDNN attention for this torch or GPU
            return False
        want = reference.attention_over(q[:n], keys, values, 0.125)
        if not torch.allclose(out.float(), want.float(), atol=2e-2, rtol=2e-2):
            return False
    return True
