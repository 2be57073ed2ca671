"""Owns the model weights and the physical KV cache of one replica, and runs scheduled batches.

The KV cache is one tensor ``[layers, 2, num_blocks, block_size, kv_heads,
head_dim]``, so any set of blocks of every layer gathers into a single
``[layers, 2, B, block_size, kv_heads, head_dim]`` payload for transfers. Block
ids come from the BlockManager; the runner never decides which block holds what.
"""

from __future__ import annotations

import torch

from lmpool.config import DTYPES, EngineConfig
from lmpool.engine.cuda_graphs import DecodeGraphs
from lmpool.engine.sampler import Sampler
from lmpool.engine.scheduler import ScheduledBatch
from lmpool.model.checkpoint import iter_safetensors
from lmpool.model.config import ModelConfig
from lmpool.model.qwen3 import AttentionMetadata, Qwen3ForCausalLM
from lmpool.ops import get_backend


def resolve_dtype(config: EngineConfig, model_config: ModelConfig) -> torch.dtype:
    if config.dtype is not None:
        return DTYPES[config.dtype]
    if torch.device(config.device).type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and inexact
    return DTYPES.get(model_config.torch_dtype, torch.bfloat16)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = resolve_dtype(config, model_config)
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads)  # process-wide: see EngineConfig.cpu_threads
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.ops = get_backend(self.device, config.use_kernels)
        with torch.device(self.device):
            self.model = Qwen3ForCausalLM(model_config, max_model_len)
        for p in self.model.parameters():  # rotary tables stay fp32
            p.data = p.data.to(self.dtype)
        self.model.load_weights(iter_safetensors(config.model))
        self.model.eval()
        self.sampler = Sampler(self.device, config.seed)
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit()
        c = model_config
        # Only written slots are ever read, so CPU memory can stay lazily mapped; on
        # CUDA the cache is zeroed so that padded graph rows read finite values.
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        self.kv_cache = alloc(
            c.num_hidden_layers, 2, self.num_blocks, self.block_size,
            c.num_key_value_heads, c.head_dim, dtype=self.dtype, device=self.device,
        )
        self.max_blocks_per_seq = (max_model_len + self.block_size - 1) // self.block_size
        self.graphs = None
        # The torch reference synchronises with the host, so only the kernels can be captured.
        if self.device.type == "cuda" and not config.enforce_eager and self.ops.name == "cuda":
            self.graphs = DecodeGraphs(self, min(config.max_num_seqs, 512))

    @property
    def block_bytes(self) -> int:
        return self.model_config.kv_bytes_per_block(self.block_size, self.dtype)

    def _blocks_that_fit(self) -> int:
        if self.device.type == "cpu":
            # Never more than every admissible sequence at full length could use.
            useful = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
            return max(1, min(useful, self.config.cpu_kv_cache_bytes // self.block_bytes))
        torch.cuda.synchronize(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        # Headroom for activations of the largest batch: hidden states, the fused
        # projections and the logits of every sampled row, a few times over.
        c = self.model_config
        tokens = self.config.max_num_batched_tokens
        width = max(c.hidden_size, c.num_attention_heads * c.head_dim) + 2 * c.intermediate_size
        activations = 4 * tokens * width * 4 + self.config.max_num_seqs * c.vocab_size * 8
        budget = total * self.config.gpu_memory_utilization - torch.cuda.memory_allocated(self.device)
        blocks = int((budget - activations) // self.block_bytes)
        if blocks < 1:
            raise ValueError(
                f"no GPU memory left for the KV cache: {budget / 2**30:.2f} GiB of the "
                f"gpu_memory_utilization budget remains after the weights"
            )
        return blocks

    # ---- one step -------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        query_start = [0]
        sample_rows: list[int] = []
        bs = self.block_size
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            context_lens.append(start + n)
            query_start.append(query_start[-1] + n)
            if batch.samples(i):
                sample_rows.append(query_start[-1] - 1)
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            is_decode=len(input_ids) == len(batch.seqs),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, sample_rows

    @torch.inference_mode()
    def forward_hidden(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.is_decode and self.graphs is not None and self.graphs.fits(len(ids), meta):
            return self.graphs.replay(ids, pos, meta)
        return self.model(ids, pos, meta, self.kv_cache, self.ops)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        """Compute one step; returns the new token of every sequence that samples, in batch order."""
        ids, pos, meta, sample_rows = self.prepare(batch)
        hidden = self.forward_hidden(ids, pos, meta)
        if not sample_rows:
            return []
        rows = torch.tensor(sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        sampling = [i for i in range(len(batch)) if batch.samples(i)]
        return self.sampler(
            logits,
            [batch.seqs[i].params for i in sampling],
            [batch.seqs[i].request_id for i in sampling],
        )
