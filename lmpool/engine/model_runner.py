"""Owns the model weights and the physical KV cache of one replica, and runs scheduled batches.

The KV cache is one tensor ``[layers, 2, num_blocks, block_size, kv_heads,
head_dim]``, so any set of blocks of every layer gathers into a single
``[layers, 2, B, block_size, kv_heads, head_dim]`` payload for transfers. Block
ids come from the BlockManager; the runner never decides which block holds what.

A step is ``launch`` (build the inputs on the host, one copy to the device, the
forward and the sampling queued) then ``PendingTokens.result`` (the step's only
wait for the device). Between the two the caller may do host work that does
not need the new tokens, and may even launch the next step: input tokens still
pending on the host are taken on the device from the previous step's sampled
tokens (``launch``'s ``previous``). The inputs of a step are valid until the
next ``prepare`` or ``launch``. All device work is queued on the current stream,
so every later step (and any reader ordered after the stream) sees it complete.
"""

from __future__ import annotations

import itertools
import warnings

import torch

from lmpool.config.engine import DTYPE_NAMES, EngineConfig, cascade_min_saved, piecewise_rows, prefill_attention
from lmpool.engine.cuda_graphs import DecodeGraphs
from lmpool.engine.logprobs import (
    PromptSlice,
    SampledLogprobs,
    prompt_logprobs,
    prompt_targets,
    sampled_logprobs,
    staged,
)
from lmpool.engine.penalties import apply_penalties
from lmpool.engine.piecewise_graphs import PiecewiseGraphs
from lmpool.engine.sampler import Sampler
from lmpool.engine.scheduler import ScheduledBatch
from lmpool.engine.sequence import Sequence
from lmpool.engine.start_phases import StartPhases
from lmpool.engine.step_inputs import StepInputBuilder, StepInputs, arena_capacity
from lmpool.engine.warm_up import warm_up
from lmpool.model.checkpoint import iter_safetensors
from lmpool.model.config import ModelConfig
from lmpool.model.qwen3 import Qwen3ForCausalLM
from lmpool.ops import dense_attention, get_backend

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
# FlashAttention over keys gathered out of the cache (``ops.cuda.flash_gathered_attention``) takes
# a prefill step whose queries times contexts (its (query, key) pairs, causal ones counted whole)
# are at least this many times its keys: the copy moves
# ~8 KB a key a layer (0.6B heads, bf16). Measured on an H100 (``results/kernels_NOTES.md``), the
# gathered FlashAttention was 9 % slower than LMPool's kernel at 256 queries a key (4 x 256 over
# 2,048), 9 % faster at 512 (8 x 512 cold) and 1.3-1.7x faster from 4,096. A burst's short
# questions over a long document stay on LMPool's kernel, which splits their keys over the GPU
# (2-9x faster there).
GATHER_KEYS_MIN_QUERY = 512


def resolve_dtype(config: EngineConfig, model_config: ModelConfig) -> torch.dtype:
    if config.dtype is not None:
        return DTYPES[config.dtype]
    if torch.device(config.device).type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and inexact
    return DTYPES.get(model_config.torch_dtype, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    """``DTYPES``' key of ``dtype`` (the configuration's name for it)."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def planned_cascades(config: EngineConfig, model_config: ModelConfig) -> int:
    """``config.engine.cascade_min_saved`` for an engine of ``config`` running this model: what
    its runner plans with and, through the ``ControlSpec``, what its pool prices with."""
    return cascade_min_saved(config, dtype_name(resolve_dtype(config, model_config)), model_config.head_dim)


def check_cache_fits(num_blocks: int, block_bytes: int, device: torch.device, utilization: float) -> None:
    """Refuse, saying why and what to change, a KV cache the device cannot hold: what it has
    free once torch has handed back what it keeps cached. ``gpu_memory_utilization`` is a
    share of the whole device, so another process on it (another pool, a training job) can
    leave less free than the share; the allocation would then fail with a bare out-of-memory
    error. Cached memory is released rather than counted: an earlier engine's cache sits in
    segments (some in CUDA graph pools) that one cache-sized allocation cannot reuse."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    message = cache_shortfall(num_blocks * block_bytes, free, str(device), num_blocks, utilization)
    if message is not None:
        raise ValueError(message)


def cache_shortfall(needed: int, available: int, device: str, num_blocks: int, utilization: float) -> str | None:
    """Why a KV cache of ``needed`` bytes cannot be had from ``available`` (None: it can)."""
    if needed <= available:
        return None
    return (f"the KV cache of {num_blocks} blocks needs {needed / 2**30:.2f} GiB but only "
            f"{available / 2**30:.2f} GiB is free on {device} (other processes hold the rest); "
            f"lower gpu_memory_utilization (now {utilization}) or set num_kv_blocks")


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
        self.start_phases = StartPhases()
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda":
            # The runner's device becomes the process's current one: CUDA graph capture,
            # streams, events and pinned copies made without a device all take the current
            # device, and a graph captured on another device's stream is invalidated.
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config, model_config)
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads)  # process-wide: see EngineConfig.cpu_threads
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        attention = prefill_attention(config, dtype_name(self.dtype), model_config.head_dim)
        self.ops = get_backend(self.device, config.use_kernels, model_config.head_dim, attention, config.block_size)
        flash = self.ops.name.startswith("cuda+flash")
        if flash and self.dtype == torch.float32:
            raise ValueError("prefill_attention 'flash' takes float16 or bfloat16; this engine runs float32")
        if attention == "flash" and not flash:
            warnings.warn(f"prefill_attention 'flash' needs LMPool's CUDA kernels; this engine runs the "
                          f"{self.ops.name} ops, which prefill as they decode", RuntimeWarning, stacklevel=2)
        if self.ops.name.startswith("cuda"):
            # Build (or load) the kernels now, not inside the first step: a pool's worker is
            # watched for hangs from the moment it is ready, and a cold build takes minutes.
            from lmpool.ops.cuda import load_extension

            load_extension().set_dependent_launch(config.dependent_launch)
        self.start_phases.lap("kernels")
        with torch.device(self.device):
            self.model = Qwen3ForCausalLM(model_config, max_model_len)
        for p in self.model.parameters():  # rotary tables stay fp32
            p.data = p.data.to(self.dtype)
        self.model.load_weights(iter_safetensors(config.model))
        self.model.eval()
        self.start_phases.lap("weights")
        self.sampler = Sampler(self.device, config.seed)
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit()
        if self.num_blocks * self.block_size >= 2**31:  # step inputs hold slots as int32
            raise ValueError(
                f"{self.num_blocks} KV blocks of {self.block_size} slots exceed int32 slot indices; "
                "lower num_kv_blocks or gpu_memory_utilization"
            )
        c = model_config
        if self.device.type == "cuda":
            check_cache_fits(self.num_blocks, self.block_bytes, self.device, config.gpu_memory_utilization)
        # Only written slots are ever read, so CPU memory can stay lazily mapped; on
        # CUDA the cache is zeroed so that padded graph rows read finite values.
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        self.kv_cache = alloc(
            c.num_hidden_layers, 2, self.num_blocks, self.block_size,
            c.num_key_value_heads, c.head_dim, dtype=self.dtype, device=self.device,
        )
        self.start_phases.lap("kv_cache")
        self.max_blocks_per_seq = (max_model_len + self.block_size - 1) // self.block_size
        self.cascade_min_saved = planned_cascades(config, model_config)  # what the pool prices with
        gather = None
        if self.ops.name == "cuda+flash-gather":
            gather = (GATHER_KEYS_MIN_QUERY, self._gathered_keys_max())
            # Its check and cuDNN's plans for each length bucket: now, not inside a prompt's step.
            dense_attention.warm(self.device, self.dtype, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                 GATHER_KEYS_MIN_QUERY, config.max_num_batched_tokens, min(max_model_len, gather[1]))
        self.inputs = StepInputBuilder(
            self.device, self.block_size,
            arena_capacity(config.max_num_batched_tokens, config.max_num_seqs, self.max_blocks_per_seq)
            + (gather[1] if gather else 0),  # room for a gathering step's key slots: it never grows while serving
            self.cascade_min_saved, gather,
        )
        self.start_phases.lap("attention_plans")
        self.graphs = None
        self.pieces = None
        # The torch reference synchronises with the host, so only the kernels can be captured.
        if self.device.type == "cuda" and not config.enforce_eager and self.ops.name.startswith("cuda"):
            self.graphs = DecodeGraphs(self, min(config.max_num_seqs, 512), self.cascade_min_saved > 0)
            piece_rows = piecewise_rows(config)
            if piece_rows:
                self.pieces = PiecewiseGraphs(self, piece_rows)
        self.start_phases.lap("graphs")
        if self.device.type == "cuda":
            warm_up(self.model, self.device, self.dtype, config.max_num_seqs, config.max_num_batched_tokens)
        self.start_phases.lap("warm_up")

    def close(self) -> None:
        """Free the device memory now (weights, KV cache, graphs, input buffers), whatever
        still refers to this runner: its graphs refer back to it, and tools wrap its
        methods, so waiting for the garbage collector could keep a whole GPU's KV cache."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing in flight may still use them
        self.graphs = None
        self.pieces = None
        # Dropped for good (the docstring says why); a closed runner is never used again.
        self.model = None  # type: ignore[assignment]
        self.kv_cache = None  # type: ignore[assignment]
        self.inputs = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            # Back to the device, not to torch's cache: the next engine (in this process or
            # another) sizes its KV cache from the device's free memory.
            torch.cuda.empty_cache()

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
        budget = total * self.config.gpu_memory_utilization - torch.cuda.memory_allocated(self.device)
        blocks = int((budget - self._activation_bytes()) // self.block_bytes)
        if blocks < 1:
            raise ValueError(
                f"no GPU memory left for the KV cache: {budget / 2**30:.2f} GiB of the "
                f"gpu_memory_utilization budget remains after the weights"
            )
        return blocks

    def _activation_bytes(self) -> int:
        """Headroom for activations of the largest batch: hidden states, the fused projections
        and the logits of every sampled row, a few times over."""
        c = self.model_config
        tokens = self.config.max_num_batched_tokens
        width = max(c.hidden_size, c.num_attention_heads * c.head_dim) + 2 * c.intermediate_size
        return 4 * tokens * width * 4 + self.config.max_num_seqs * c.vocab_size * 8

    def _gathered_keys_max(self) -> int:
        """The most keys a prefill step gathers for FlashAttention (``GATHER_KEYS_MIN_QUERY``): their
        keys and values, one layer's at a time, in a quarter of the activations' headroom. Long
        queries over many long contexts (16 chunks of 1,024 tokens over 32k each: 2 GiB a layer)
        stay on LMPool's kernel, which reads the cache in place."""
        c = self.model_config
        per_key = 2 * c.num_key_value_heads * c.head_dim * self.dtype.itemsize
        return self._activation_bytes() // 4 // per_key

    # ---- one step -------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The step's device inputs (ids, positions, metadata), valid until the next ``prepare``."""
        return self.inputs.build(batch, self.graphs, self.pieces)

    @torch.inference_mode()
    def forward_hidden(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states of every token row; a step ``prepare`` padded for graphs replays them."""
        if inputs.graph_size is not None and self.graphs is not None:
            return self.graphs.replay(inputs)
        if inputs.piece_size is not None and self.pieces is not None:
            return self.pieces.run(inputs)
        return self.model(inputs.ids, inputs.positions, inputs.meta, self.kv_cache, self.ops)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: torch.Tensor | None = None) -> PendingTokens:
        """Queue one step on the device; the tokens are read back by ``PendingTokens.result``.

        ``previous`` holds the sampled tokens of the step launched before this one
        (``PendingTokens.device_tokens``); it is needed when a sequence's input token is
        still pending. On CUDA nothing here waits for the device, so the caller can do
        host work that does not need the new tokens while the step runs.
        """
        started = None
        if self.device.type == "cuda":  # the step's start on the device's clock (``PendingTokens.device_s``)
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        inputs = self.prepare(batch)
        if inputs.fill is not None:
            fill_pending_ids(inputs, previous)
        hidden = self.forward_hidden(inputs)
        prompt = self._prompt_logprobs(batch, hidden) if batch.prompt_logprobs else []
        if inputs.sample_index is None:
            seqs = batch.seqs
        else:
            seqs = [batch.seqs[i] for i in inputs.sample_index]
            if not seqs:
                return PendingTokens([], None, started=started, prompt=prompt, device=self.device)
        if inputs.sample_rows is not None:
            hidden = hidden.index_select(0, inputs.sample_rows)
        tokens, finite, logprobs = self.sample_checked(hidden, seqs, previous)
        return PendingTokens(seqs, tokens, finite, started=started, logprobs=logprobs, prompt=prompt)

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor) -> list[PromptSlice]:
        """The prompt logprobs this step's rows give the sequences that ask (``batch.prompt_logprobs``)."""
        rows = [0, *itertools.accumulate(batch.num_tokens)]  # each sequence's first token row
        slices = []
        for i in batch.prompt_logprobs:
            seq, start = batch.seqs[i], batch.seqs[i].num_computed_tokens
            count = prompt_targets(seq, start, batch.num_tokens[i])
            if count:
                slices.append(prompt_logprobs(self._logits, hidden, seq, rows[i], start, count))
        return slices

    def _logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """``compute_logits`` through this runner's ops, for sampled tokens and prompt logprobs alike."""
        return self.model.compute_logits(hidden, fp32=fp32, ops=self.ops)

    def sample(self, hidden: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Next token of each row of ``hidden`` (one per sequence of ``seqs``), left on the device."""
        return self.sample_checked(hidden, seqs)[0]

    def sample_checked(self, hidden: torch.Tensor, seqs: list[Sequence], previous: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, SampledLogprobs | None]:
        """``sample``'s tokens, per row whether its logits were all finite (both on the device: a
        row's NaN or inf must fail its request, and checking costs no wait for the device), and
        the logprobs of the rows whose requests ask (``lmpool.engine.logprobs``). Penalties
        count a pending token from ``previous``, the previous step's sampled tokens."""
        if all(s.plain_greedy for s in seqs):
            # Greedy rows only: argmax of the model-dtype logits equals the sampler's
            # argmax of their (exact) fp32 cast, without materialising that copy.
            logits = self._logits(hidden, fp32=False)
            return logits.argmax(dim=-1), finite_rows(logits), None
        logits = self._logits(hidden)
        params = [s.params for s in seqs]
        penalized = apply_penalties(logits, seqs, previous)
        tokens = self.sampler.sample(penalized, params, [s.request_id for s in seqs])
        return tokens, finite_rows(logits), sampled_logprobs(logits, tokens, params)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """True for each row of ``logits[B, vocab]`` with no NaN or inf (a bool tensor on their device)."""
    return torch.isfinite(logits).all(dim=-1)


def fill_pending_ids(inputs: StepInputs, previous: torch.Tensor | None) -> None:
    """Copy the pending input tokens from the previous step's sampled ones, on the device
    (queued after that step's sampling, so they are there when this step reads them)."""
    if previous is None:
        raise ValueError("a step with pending input tokens needs the previous step's sampled tokens")
    assert inputs.fill is not None  # a step with pending input tokens has their rows
    rows, sources = inputs.fill.long()
    inputs.ids.index_copy_(0, rows, previous.index_select(0, sources).to(inputs.ids.dtype))


NON_FINITE = -1
"""The token ``PendingTokens.result`` gives a row whose logits were not all finite."""


class PendingTokens:
    """The tokens of a launched step: ``seqs`` in batch order, read back to the host once.

    On CUDA the device-to-host copy is queued at once into pinned memory and an
    event marks its end, so ``result`` waits for exactly that step (the only
    host synchronisation of a step) and never copies twice. ``device_tokens``
    stays on the device for the next step to read its pending input tokens from.
    A step that samples nothing (a long prompt's earlier chunk) has its event too
    (``device``): the host waits for it as for any step, so an overlapped engine
    keeps at most one step queued behind the one running. Unwaited, chunk after
    chunk filled the device's launch queue, and the next launch then held the
    host for whole chunks (722 ms measured on an H200 under MPS).

    A row whose ``finite`` flag is False reads back as ``NON_FINITE``: the flag
    rides in the one copy of the tokens instead of a second read-back. Its
    ``device_tokens`` entry is 0, a valid input id for a next step that may
    already compute the (doomed) sequence, whatever the argmax of NaN gave.

    Given the event of the step's start (``started``), the end event times too, so that
    ``device_s`` gives the step's seconds on the device's clock. ``logprobs`` (of the sampled
    rows that asked) and ``prompt`` (prompt logprobs) were queued before the token copy, so
    they are complete once the tokens are; they are read on demand, only when there are any.
    """

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor | None,
                 finite: torch.Tensor | None = None, started: torch.cuda.Event | None = None,
                 logprobs: SampledLogprobs | None = None, prompt: list[PromptSlice] | None = None,
                 device: torch.device | None = None) -> None:
        self.seqs = seqs
        self.logprobs = logprobs
        self.prompt = prompt or []
        self.device_tokens: torch.Tensor | None
        if tokens is not None and finite is not None:
            bad = ~finite
            self.device_tokens = tokens.masked_fill(bad, 0)
            tokens = tokens.masked_fill(bad, NON_FINITE)
        else:
            self.device_tokens = tokens
        self._tokens = tokens
        self._done = None
        self.started = started
        if tokens is not None:
            device = tokens.device
        elif self.prompt:
            device = self.prompt[0].logprobs.chosen.device
        if device is not None and device.type == "cuda":
            # Logprobs are staged on the host with the tokens: reading them from the device later
            # would wait for whatever step was launched since (overlapped stepping's next one).
            if logprobs is not None:
                logprobs.logprobs = logprobs.logprobs.staged()
            for part in self.prompt:
                part.logprobs = part.logprobs.staged()
            if tokens is not None:
                self._tokens = staged(tokens)
            self._done = torch.cuda.Event(enable_timing=started is not None)
            self._done.record(torch.cuda.current_stream(device))  # the copies' stream, whatever device is current
        self._result: list[int] | None = None

    def ready(self) -> bool:
        """Whether ``result`` would return without waiting for the device."""
        return self._result is not None or self._done is None or self._done.query()

    def result(self) -> list[int]:
        """The tokens (the step's one wait for the device); its logprobs are readable after it."""
        if self._result is None:
            if self._done is not None:
                self._done.synchronize()
            self._result = [] if self._tokens is None else self._tokens.tolist()
        return self._result

    def token_logprobs(self) -> list | None:
        """Per row, once read back: the sampled token's ``TokenLogprobs`` where its request asked
        (None elsewhere); None when no row asked."""
        return None if self.logprobs is None else self.logprobs.by_row(len(self.seqs))

    def device_s(self, previous: PendingTokens | None) -> float | None:
        """Once read back, the seconds this step held the device: from the end of ``previous``
        (the step before it on the stream) or from its own start if that came later (the device
        waited for it), to its end. Under overlapped stepping a step's kernels are queued while
        the one before runs, and when the host queues them more slowly than the device runs
        them, that delay is this step's: host-side intervals would charge it to the step before.
        None without timing events (a CPU)."""
        if self._done is None or self.started is None or self._result is None:
            return None
        begin = self.started
        if previous is not None and previous.started is not None and previous._done is not None:
            if previous._done.elapsed_time(self.started) < 0:  # it started before the previous one ended
                begin = previous._done
        return begin.elapsed_time(self._done) / 1e3
