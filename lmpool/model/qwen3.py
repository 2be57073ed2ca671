"""Qwen3 dense decoder in plain torch, reading and writing a paged KV cache.

Numerics follow ``transformers``' Qwen3 so that the two agree on the same
weights: RMSNorm in fp32 then cast back, q/k RMSNorm per head before rotary
embedding (rotate-half form, ``rope_theta`` from the config, YaRN-scaled when the config
asks: ``lmpool.model.rope``), grouped-query
attention with scale ``head_dim ** -0.5``, SwiGLU MLP, residual adds in the
model dtype. q/k/v and gate/up projections are fused at load time so a layer
runs two matmuls where the checkpoint has five.

Attention is delegated to a ``KVOps`` backend; every forward first writes this
step's keys and values into the cache, then attends over the cache only. The norms (each
with the residual add before it), the q/k norm-then-rotate with the store of this step's keys
and values, and SwiGLU's gating go through the backend too: on CUDA each is one kernel where
plain torch launches two to twenty (``kernels/norm_rope.cu``, ``kernels/silu_mul.cu``, same
roundings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple, cast

import torch
from torch import nn

from lmpool.model.config import ModelConfig
from lmpool.model.rope import YarnScaling, inv_freq
from lmpool.ops import TORCH_OPS, KVOps


class CascadeInputs(NamedTuple):
    """A decode step's groups of rows sharing a cached prefix, as ``ops.cascade_decode_attention``
    takes them (``lmpool.engine.cascade``), all int32."""

    kv_start: torch.Tensor  # [B] the first key each row attends to on its own (0: in no group)
    prefix_tables: torch.Tensor  # [G, V] each group's prefix blocks
    prefix_lens: torch.Tensor  # [G] each group's prefix tokens
    prefix_starts: torch.Tensor  # [G + 1] group g is prefix_rows[prefix_starts[g]:prefix_starts[g + 1]]
    prefix_rows: torch.Tensor  # [J] the grouped rows, group by group


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what they attend to (see ``lmpool.ops.reference``)."""

    slot_mapping: torch.Tensor  # [T] int32 or int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    is_decode: bool  # every sequence has exactly one new token
    # Decode rows reading shared prefixes once: a decode step's, or a mixed step's first
    # ``mixed_decode_rows`` (its single-token rows, listed first; the rest attend as a prefill
    # whose query starts are ``mixed_query_start_loc``).
    cascade: CascadeInputs | None = None
    mixed_decode_rows: int = 0
    mixed_query_start_loc: torch.Tensor | None = None  # [B - mixed_decode_rows + 1] int32
    # A step that prefills: its contexts' cumulative lengths ([B + 1] int32; the rest's, after a
    # mixed cascade's rows), its longest query and context (for ``ops.paged_attention``'s backends
    # that size their launch on the host).
    key_starts: torch.Tensor | None = None
    mixed_key_starts: torch.Tensor | None = None
    max_query_len: int = 0
    max_context_len: int = 0
    # A step that prefills long queries, where the backend reads keys gathered out of the cache
    # (``StepInputBuilder``'s ``gather_keys``): every context's slots, context after
    # context ([key_starts[-1]] int32).
    key_slots: torch.Tensor | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, ops: KVOps = TORCH_OPS) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def after_add(self, x: torch.Tensor, residual: torch.Tensor,
                  ops: KVOps = TORCH_OPS) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of ``x + residual``, ``x + residual``): the residual add and its norm."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def project(layer: nn.Linear, x: torch.Tensor, ops: KVOps) -> torch.Tensor:
    """``layer(x)`` through ``ops.linear`` (a decode step's few rows read each weight once on
    CUDA); a layer with a bias runs as torch's."""
    return layer(x) if layer.bias is not None else ops.linear(x, layer.weight)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: YarnScaling | None = None) -> None:
        super().__init__()
        freq, scale = inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), freq)
        # fp32 [max_positions, head_dim / 2] tables, applied by ``ops.qkv_norm_rope_store``.
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)



class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def queries(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, slot_mapping: torch.Tensor,
                kv_cache: torch.Tensor, ops: KVOps) -> torch.Tensor:
        """q ``[T, heads, head_dim]``, normed per head and rotated; this step's keys and values
        (normed and rotated, as stored) written at their slots (-1: nowhere)."""
        return ops.qkv_norm_rope_store(project(self.qkv_proj, x, ops), self.q_norm.weight, self.k_norm.weight,
                                       self.q_norm.eps, rotary.cos, rotary.sin, positions, kv_cache[0], kv_cache[1],
                                       slot_mapping, self.num_heads)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor, ops: KVOps) -> torch.Tensor:
        """The attention of ``q`` over the cache as ``meta`` lays it out, ``[T, heads * head_dim]``."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if meta.mixed_decode_rows:
            o = self._mixed_cascade(q, k_cache, v_cache, meta, ops)
        elif meta.is_decode and meta.cascade is not None:
            o = ops.cascade_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, *meta.cascade, self.scale
            )
        elif meta.is_decode:
            o = ops.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale
            )
        else:
            o = ops.paged_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc, self.scale,
                meta.key_starts, meta.max_query_len, meta.max_context_len, meta.key_slots,
            )
        return o.reshape(-1, self.q_size)

    def output(self, o: torch.Tensor, ops: KVOps) -> torch.Tensor:
        return project(self.o_proj, o, ops)

    def _mixed_cascade(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       ops: KVOps) -> torch.Tensor:
        """A mixed step's attention: its decode rows (the first ``d``) as a cascade, the rest as a prefill."""
        d, tables, lens = meta.mixed_decode_rows, meta.block_tables, meta.context_lens
        assert meta.cascade is not None and meta.mixed_query_start_loc is not None
        decoded = ops.cascade_decode_attention(q[:d], k_cache, v_cache, tables[:d], lens[:d], *meta.cascade, self.scale)
        rest = ops.paged_attention(q[d:], k_cache, v_cache, tables[d:], lens[d:], meta.mixed_query_start_loc,
                                   self.scale, meta.mixed_key_starts, meta.max_query_len, meta.max_context_len)
        return torch.cat((decoded, rest))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: KVOps = TORCH_OPS) -> torch.Tensor:
        return project(self.down_proj, ops.silu_mul(project(self.gate_up_proj, x, ops)), ops)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        ops: KVOps,
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]``; ``kv_cache`` is ``[layers, 2, blocks, ...]``.

        The residual stream: each sublayer's output is added to it by the norm that reads the
        sum (one kernel on CUDA), with the roundings of ``h = h + sublayer(norm(h))``. The
        pieces between two attentions (``first_queries``, ``after_attention``,
        ``next_queries``, ``final_norm``) are what ``lmpool.engine.piecewise_graphs`` captures.
        """
        q, residual = self.first_queries(input_ids, positions, meta.slot_mapping, kv_cache, ops)
        for i in range(len(self.layers)):
            out, residual = self.after_attention(i, self.attend(i, q, meta, kv_cache, ops), residual, ops)
            if i + 1 < len(self.layers):
                q, residual = self.next_queries(i + 1, out, residual, positions, meta.slot_mapping, kv_cache, ops)
        return self.final_norm(out, residual, ops)

    def layer(self, i: int) -> DecoderLayer:
        return cast(DecoderLayer, self.layers[i])

    def first_queries(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_cache: torch.Tensor, ops: KVOps) -> tuple[torch.Tensor, torch.Tensor]:
        """The first layer up to its attention: (its queries, the residual stream)."""
        residual = self.embed_tokens(input_ids)
        layer = self.layer(0)
        x = layer.input_layernorm(residual, ops)
        return layer.self_attn.queries(x, positions, self.rotary, slot_mapping, kv_cache[0], ops), residual

    def attend(self, i: int, q: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
               ops: KVOps) -> torch.Tensor:
        """Layer ``i``'s attention (the only part of a layer that reads other tokens' keys)."""
        return self.layer(i).self_attn.attend(q, meta, kv_cache[i], ops)

    def after_attention(self, i: int, o: torch.Tensor, residual: torch.Tensor,
                        ops: KVOps) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i`` after its attention: (its MLP's output, the residual stream before it)."""
        layer = self.layer(i)
        x, residual = layer.post_attention_layernorm.after_add(layer.self_attn.output(o, ops), residual, ops)
        return layer.mlp(x, ops), residual

    def next_queries(self, i: int, out: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                     slot_mapping: torch.Tensor, kv_cache: torch.Tensor,
                     ops: KVOps) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i`` up to its attention, given the layer before's output: (queries, residual)."""
        layer = self.layer(i)
        x, residual = layer.input_layernorm.after_add(out, residual, ops)
        return layer.self_attn.queries(x, positions, self.rotary, slot_mapping, kv_cache[i], ops), residual

    def final_norm(self, out: torch.Tensor, residual: torch.Tensor, ops: KVOps) -> torch.Tensor:
        return self.norm.after_add(out, residual, ops)[0]

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True, ops: KVOps = TORCH_OPS) -> torch.Tensor:
        """Logits of ``hidden[R, hidden]``, cast to fp32 unless ``fp32`` is False.

        The cast is exact, so the model-dtype logits have the same argmax (greedy
        decoding skips writing and reading a ``[R, vocab]`` fp32 copy).
        """
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = ops.linear(hidden, weight)
        return logits.float() if fp32 else logits

    # ---- weights ---------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face Qwen3 tensors, fusing q/k/v and gate/up; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        c = self.config
        q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        fused = {  # checkpoint suffix -> (our suffix, row offset, rows)
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
            "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
        }
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model."):]
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the output projection
            target, rows = name, None
            for src, (dst, offset, size) in fused.items():
                if f".{src}." in name:
                    target, rows = name.replace(src, dst), (offset, size)
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in a Qwen3 model")
            dest = param.data if rows is None else param.data[rows[0] : rows[0] + rows[1]]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(f"{target}@{rows}")
        expected: set[str] = set()
        for pname in params:
            parts: list[tuple[int, int] | None] = [
                (offset, size)
                for dst, offset, size in fused.values()
                if pname.endswith((f"{dst}.weight", f"{dst}.bias"))
            ]
            expected.update(f"{pname}@{rows}" for rows in parts or [None])
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[0].split('@')[0]}")
