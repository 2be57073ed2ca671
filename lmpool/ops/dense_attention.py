"""One sequence's prefill attention over its keys and values gathered into one run, through
torch's dense attention (``scaled_dot_product_attention``, whose cuDNN kernels on Hopper ran
a long causal prompt at twice FlashAttention 2's varlen rate: ``results/kernels_NOTES.md``).

Dense attention aligns its causal mask top left, while a sequence's new queries end its
context. A context longer than its query therefore splits in two: the queries over the cached
prefix (every key visible; the query heads sharing a key head folded into one run of rows) and
over their own keys (causal), merged by each row's log-sum-exp of scores.

Invariants: the result equals ``reference.paged_attention`` on the same keys up to rounding
(``usable`` checks that on a small case before a device's first use, and answers False where
the kernels are missing or disagree, so the caller keeps its own path); no host sync outside
that check.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmpool.ops import reference

_FUSED = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
_ANY = [*_FUSED, SDPBackend.MATH]


def one_sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` (``[n, q_heads, d]``, the last ``n`` positions of the context)
    over ``k`` and ``v`` (``[ctx, kv_heads, d]``, ``ctx >= n``): ``[n, q_heads, d]`` in ``q``'s dtype."""
    n, ctx = q.shape[0], k.shape[0]
    if ctx == n:
        # Fused kernels only on a GPU: the math fallback would hold every score ([heads, n, n]).
        with sdpa_kernel(_FUSED if q.is_cuda else _ANY):
            out = F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v), is_causal=True, scale=scale,
                                                 enable_gqa=True)
        return out[0].transpose(0, 1)
    group = q.shape[1] // k.shape[1]
    prefix = ctx - n
    over_prefix, prefix_lse = _folded_attention(q, k[:prefix], v[:prefix], group, scale)
    own_k, own_v = (x[prefix:].repeat_interleave(group, dim=1) for x in (k, v))
    own, own_lse = attend_with_lse(_bhsd(q), _bhsd(own_k), _bhsd(own_v), True, scale)
    return merge(over_prefix, prefix_lse, own[0].transpose(0, 1), own_lse[0].transpose(0, 1)).to(q.dtype)


def _folded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of ``q`` over ``k``, ``v`` with the ``group`` query heads of each key
    head as one run of ``group * n`` rows (no key copied per query head): ``[n, q_heads, d]`` and
    the rows' log-sum-exps ``[n, q_heads]``."""
    n, q_heads, d = q.shape
    kv_heads = k.shape[1]
    rows = q.view(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(1, kv_heads, group * n, d)
    out, lse = attend_with_lse(rows, _bhsd(k), _bhsd(v), False, scale)
    out = out.view(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, q_heads, d)
    return out, lse.reshape(kv_heads, group, n).permute(2, 0, 1).reshape(n, q_heads)


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


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """``[S, H, d]`` as dense attention's ``[1, H, S, d]``, contiguous."""
    return x.transpose(0, 1).unsqueeze(0).contiguous()


@functools.cache
def usable(device: torch.device) -> bool:
    """Whether ``one_sequence_attention`` runs on ``device`` and matches the reference there, for
    a cold query and one after a cached prefix (96 tokens each, GQA of 2, bf16 on a GPU); checked
    once a device."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(96, 4, 64, generator=gen).to(device, dtype)
    k, v = (torch.randn(192, 2, 64, generator=gen).to(device, dtype) for _ in range(2))
    for keys, values in ((k[:96], v[:96]), (k, v)):
        try:
            out = one_sequence_attention(q, keys, values, 0.125)
        except (RuntimeError, NotImplementedError):  # no fused or cuDNN attention for this torch or GPU
            return False
        want = reference.attention_over(q, keys, values, 0.125)
        if not torch.allclose(out.float(), want.float(), atol=2e-2, rtol=2e-2):
            return False
    return True
