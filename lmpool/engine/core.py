"""One replica's engine loop: admission checks, scheduling, the model step and stop conditions.

``EngineCore`` is driven from outside (``LLM.generate`` or a pool worker): add
requests, call ``step()`` until nothing is unfinished. A request that is
invalid, or that could never fit in this replica's KV cache, is refused with a
``ValueError`` at ``add_request`` and never disturbs the requests already in.

A step launches the model on the device, then does the block accounting of the
batch (``Scheduler.complete_step``) while the device computes, and only then
waits for the new tokens. That overlap is correct because the accounting reads
only the batch and the tokens already known: sampled tokens are appended after
it, as they always were.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

from lmpool.config.engine import EngineConfig
from lmpool.engine.block_manager import BlockManager
from lmpool.engine.model_runner import ModelRunner
from lmpool.engine.scheduler import Scheduler
from lmpool.engine.sequence import Sequence
from lmpool.engine.validation import validate_request
from lmpool.model.config import ModelConfig
from lmpool.sampling_params import SamplingParams


@dataclass(slots=True)
class StepOutput:
    request_id: str
    new_token_id: int
    finished: bool
    finish_reason: str | None
    seq: Sequence


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        limit = self.model_config.max_context
        self.max_model_len = config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context of {limit} positions "
                "(max_position_embeddings, or YaRN's factor times its original positions)"
            )
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.requests: dict[str, Sequence] = {}

    # ---- admission ------------------------------------------------------------

    def validate(self, prompt_token_ids: SequenceABC[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming what is wrong with a request; return if it can be served."""
        validate_request(
            prompt_token_ids, params, vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len, block_size=self.config.block_size,
            max_blocks=self.block_manager.num_blocks,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceABC[int],
        params: SamplingParams,
        output_token_ids: SequenceABC[int] = (),
    ) -> Sequence:
        """Queue a request; ``output_token_ids`` resumes one whose first tokens were generated elsewhere."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        seq = Sequence(
            request_id, list(prompt_token_ids), params, self.config.block_size, list(output_token_ids)
        )
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks; an unknown id is a no-op that returns False."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(seq)
        self.runner.sampler.release(request_id)
        return True

    def close(self) -> None:
        """Release the replica's device memory; the engine cannot step afterwards."""
        self.runner.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        pending = self.runner.launch(batch)
        # Block accounting needs only the batch, not the new tokens: it runs while
        # the device computes them.
        self.scheduler.complete_step(batch)
        tokens = pending.result()
        outputs = []
        append = outputs.append
        eos, max_len = self.eos_token_ids, self.max_model_len
        # Stop conditions inline: this loop runs once per sequence per step.
        for seq, token in zip(pending.seqs, tokens):
            seq.append_token(token)
            params = seq.params
            length = len(seq.token_ids)
            if token in params.stop_token_ids or (token in eos and not params.ignore_eos):
                reason = "stop"
            elif length - seq.num_prompt_tokens >= params.max_tokens or length >= max_len:
                reason = "length"
            else:
                append(StepOutput(seq.request_id, token, False, None, seq))
                continue
            self.scheduler.running.remove(seq)
            self.scheduler.finish(seq, reason)
            self.runner.sampler.release(seq.request_id)
            del self.requests[seq.request_id]
            append(StepOutput(seq.request_id, token, True, reason, seq))
        return outputs
