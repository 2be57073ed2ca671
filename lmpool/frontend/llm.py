"""``LLM``: the synchronous single-replica API, shaped like ``vllm.LLM``."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC

from lmpool.config.engine import EngineConfig
from lmpool.engine.core import EngineCore, StepOutput
from lmpool.errors import ArgumentTypeError
from lmpool.frontend.output_processor import OutputProcessor, RequestState
from lmpool.outputs import RequestOutput
from lmpool.sampling_params import SamplingParams
from lmpool.stop_strings import check_usable
from lmpool.tokenizer import encode_chats, encode_prompt, is_token_id, load_tokenizer

Prompt = str | SequenceABC[int]


def normalize_prompts(prompts: Prompt | SequenceABC[Prompt]) -> list[Prompt]:
    """One prompt or many: a string or a flat list of token ids (Python, numpy or torch integers,
    or a 1-D array or tensor) is a single prompt; a 2-D array or tensor is one prompt per row.
    Anything else (None, bytes, a dict, a number) is an ``ArgumentTypeError`` naming it:
    bytes are not token ids, nor is a dict text."""
    if isinstance(prompts, str):
        return [prompts]
    if hasattr(prompts, "tolist") and not isinstance(prompts, (list, tuple)):  # numpy array, torch tensor
        listed = prompts.tolist()
        prompts = listed if isinstance(listed, list) else [listed]  # a 0-d array: one token id
    if not isinstance(prompts, (list, tuple)):
        raise ArgumentTypeError(f"prompts must be text, token ids, or a list of them; got {_described(prompts)}")
    items = list(prompts)
    if items and all(is_token_id(t) for t in items):
        return [items]
    for i, prompt in enumerate(items):
        if not (isinstance(prompt, (str, list, tuple)) or hasattr(prompt, "tolist")):
            raise ArgumentTypeError(f"prompt {i} must be text or a sequence of token ids, got {_described(prompt)}")
    return items


def _described(value) -> str:
    return f"{type(value).__name__} {value!r}"[:120]


def normalize_params(
    params: SamplingParams | SequenceABC[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"sampling params must be a SamplingParams or a list of them, got {type(params).__name__}")
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params


def prepare_batch(
    prompts: Prompt | SequenceABC[Prompt],
    sampling_params: SamplingParams | SequenceABC[SamplingParams] | None,
    encode: Callable[[Prompt], list[int]],
    validate: Callable[[list[int], SamplingParams], None],
) -> tuple[list[list[int]], list[SamplingParams]]:
    """Token ids and params of every prompt, each checked before any is run; an error names the prompt."""
    prompt_list = normalize_prompts(prompts)
    params = normalize_params(sampling_params, len(prompt_list))
    token_lists = []
    for i, (prompt, p) in enumerate(zip(prompt_list, params)):
        try:
            ids = encode(prompt)
            validate(ids, p)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        token_lists.append(ids)
    return token_lists, params


class LLM:
    """Generate from a Qwen3 checkpoint directory on one device.

    >>> llm = LLM("path/to/qwen3", device="cpu")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))[0].text
    """

    def __init__(self, model: str, **engine_args) -> None:
        self.config = EngineConfig(model=str(model), **engine_args)
        self.engine: EngineCore | None = EngineCore(self.config)  # None once shut down
        self.tokenizer = load_tokenizer(model)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def encode(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def decode(self, token_ids: list[int]) -> str | None:
        return self.output_processor.decode(token_ids)

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. Every prompt is checked before any runs.

        A request that fails while running (the model gave NaN or inf logits for it) raises
        a ``ValueError`` naming its prompt; the call's other requests are stopped."""
        if self.engine is None:
            raise RuntimeError("this LLM was shut down: create a new one to generate again")
        engine = self.engine

        def validate(ids: list[int], p: SamplingParams) -> None:
            check_usable(p, self.tokenizer)
            engine.validate(ids, p)

        token_lists, params = prepare_batch(prompts, sampling_params, self.encode, validate)
        request_ids = [f"llm-{next(self._ids)}" for _ in token_lists]
        states: dict[str, RequestState] = {}
        for rid, ids, p in zip(request_ids, token_lists, params):
            states[rid] = self.output_processor.new_request(rid, ids, p)
            engine.add_request(rid, ids, p)
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(request_ids):
                for out in engine.step():
                    if out.error is not None:
                        raise ValueError(
                            f"prompt {request_ids.index(out.request_id)} (request {out.request_id!r}): {out.error}")
                    final = self._process(states[out.request_id], out)
                    if final is not None:
                        done[out.request_id] = final
        finally:
            for rid in request_ids:  # an interrupted call leaves nothing behind
                if rid not in done:
                    engine.abort_request(rid)
        return [done[rid] for rid in request_ids]

    def _process(self, state: RequestState, out: StepOutput) -> RequestOutput | None:
        """Feed a step's new token to its request's output; the final output, once there is one."""
        state.num_cached_tokens = out.seq.num_cached_tokens
        logprobs = () if out.logprobs is None else (out.logprobs,)
        final = state.update([out.new_token_id], out.finish_reason, logprobs, out.prompt_logprobs)
        if final is not None and not out.finished:  # a stop string ended it: so must the engine
            assert self.engine is not None  # generate() is running
            self.engine.abort_request(out.request_id)
        return final

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        **template_kwargs,
    ) -> list[RequestOutput]:
        """``generate`` for one conversation (a list of ``{"role", "content"}`` dicts) or a list
        of them, each rendered by the tokenizer's chat template with the assistant's turn
        opened; ``template_kwargs`` reach the template (Qwen3's takes ``enable_thinking``)."""
        return self.generate(encode_chats(self.tokenizer, conversations, template_kwargs), sampling_params)

    def shutdown(self) -> None:
        """Free the weights and the KV cache now. Idempotent."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
