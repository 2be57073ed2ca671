"""A ``GenerateRequest``'s sampling settings (``vllm_engine.proto``) as LMPool's ``SamplingParams``.

proto3 leaves an unset scalar at zero, so zero reads as "unset" where vLLM's servicer reads it
so (``top_p``, ``top_k``, ``repetition_penalty``), and an unset ``temperature`` or ``max_tokens``
(optional fields) as vLLM's defaults: 1.0, and as many tokens as the context leaves. Presence,
frequency and repetition penalties are the engine's (as vLLM applies them). A setting that would
change the output and that this servicer does not carry (``n`` above 1, logprobs, ``min_p``,
``min_tokens``, ``logit_bias``, a structured-output constraint...) is refused, as the HTTP
server refuses what it lacks, rather than ignored: ``ValueError`` naming it, which the servicer
answers with ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

from lmpool.sampling_params import SamplingParams

# Fields whose proto default is their no-op value: set to anything else, they are refused.
_NO_OP = {"min_p": 0.0, "min_tokens": 0, "include_stop_str_in_output": False, "grammar_from_first_token": False}
# Optional fields refused whenever they are present.
_ABSENT = ("logprobs", "prompt_logprobs", "truncate_prompt_tokens")


def sampling_params(proto, default_max_tokens: int) -> SamplingParams:
    """``proto``'s ``SamplingParams`` for LMPool; ``default_max_tokens`` when it names none."""
    _refuse_unsupported(proto)
    fields = {"max_tokens": proto.max_tokens if proto.HasField("max_tokens") else default_max_tokens,
              "ignore_eos": proto.ignore_eos, "stop": tuple(proto.stop), "stop_token_ids": tuple(proto.stop_token_ids)}
    if proto.HasField("temperature"):
        fields["temperature"] = proto.temperature
    if proto.top_p:
        fields["top_p"] = proto.top_p
    if proto.top_k:
        fields["top_k"] = proto.top_k
    if proto.HasField("seed"):
        fields["seed"] = proto.seed
    if proto.repetition_penalty:
        fields["repetition_penalty"] = proto.repetition_penalty
    return SamplingParams(presence_penalty=proto.presence_penalty, frequency_penalty=proto.frequency_penalty,
                          **fields)


def _refuse_unsupported(proto) -> None:
    for name, no_op in _NO_OP.items():
        if getattr(proto, name) != no_op:
            raise ValueError(f"{name} is not supported by this server (got {getattr(proto, name)!r})")
    for name in _ABSENT:
        if proto.HasField(name):
            raise ValueError(f"{name} is not supported by this server")
    if proto.n > 1:
        raise ValueError(f"n above 1 is not supported by this server (got {proto.n})")
    if proto.logit_bias:
        raise ValueError("logit_bias is not supported by this server")
    constraint = proto.WhichOneof("constraint")
    if constraint is not None:
        raise ValueError(f"structured outputs ({constraint}) are not supported by this server")
