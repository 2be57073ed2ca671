"""OpenAI request bodies for ``/v1/completions`` and ``/v1/chat/completions``, and their
translation into ``SamplingParams``.

Unknown fields are accepted and ignored, as vLLM and SGLang do: clients and gateways send
fields (``user``, ``metadata``...) that a server may not act on. But a field of OpenAI's or
vLLM's API that would change the output (``logprobs``, ``presence_penalty``, ``echo``...) is
refused unless it holds its no-op value (``UNSUPPORTED``): ignoring it would answer something
other than what was asked. Every field that is acted on is validated here or by
``SamplingParams``; either failure is a 400 for the caller.

A list names its first bad item only (``fail_fast``): pydantic otherwise reports every bad item,
for each member of a union, so a 4 MB prompt of mixed ids and strings made 4 million errors,
six seconds and a gigabyte of them.

Each request model is its head (every field but the prompt or the messages: ``HEADS``) plus the
prompt or messages, which ``prompt_input()`` resolves into what the pool takes. The body-parsing
process (``body_parser``) sends the head and the resolved prompt back separately.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator, \
    model_validator

from lmpool.sampling_params import SamplingParams

# OpenAI's default for /v1/completions.
DEFAULT_COMPLETION_TOKENS = 16

# Fields of OpenAI's and vLLM's requests that this server does not implement, each with the
# values that leave the output as it is (what clients send as defaults); any other is refused.
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "logprobs": (None, False), "top_logprobs": (None, 0), "prompt_logprobs": (None,),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "logit_bias": (None, {}), "min_tokens": (None, 0), "min_p": (None, 0),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "use_beam_search": (None, False), "include_stop_str_in_output": (None, False),
    "truncate_prompt_tokens": (None,), "chat_template": (None,), "add_generation_prompt": (None, True),
    "continue_final_message": (None, False), "documents": (None, []), "functions": (None, []),
    "function_call": (None, "none", "auto"), "bad_words": (None, []), "allowed_token_ids": (None,),
    "skip_special_tokens": (None, True),
}


# The most characters a request's stop strings may hold together. Each streamed token's text is
# searched for them on the server's event loop, at a cost that grows with their number and
# length (with the square of the longest): 100,000 stop strings cost 30 ms per token, stalling
# every other request. OpenAI's API takes 4 stop strings.
MAX_STOP_CHARS = 4096


# A list validated up to its first bad item (this module's docstring says why); union members
# keep their names in error locations ("prompt.list[int].3").
_FIRST_ERROR = Field(fail_fast=True)
IntList = Annotated[list[StrictInt], _FIRST_ERROR]
StrList = Annotated[list[StrictStr], _FIRST_ERROR]


def _no_op(value, neutral: tuple) -> bool:
    # A bool only matches a bool: logprobs=0 (the sampled token's logprob) is not logprobs=false.
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    # Strict: a bool or a numeric string is not taken for a number (an int is).
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | StrList | None = None
    stop_token_ids: IntList | None = None
    ignore_eos: StrictBool = False
    # OpenAI's API takes null for either, meaning the default (clients send it).
    n: StrictInt | None = 1
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's fields: a tenant's salt keeps its prefix-cache hits to itself; return_token_ids
    # adds the prompt's and the output's token ids to the response.
    cache_salt: StrictStr | None = None
    return_token_ids: StrictBool = False

    @model_validator(mode="after")
    def _no_unsupported_fields(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and not _no_op(value, UNSUPPORTED[name]):
                raise ValueError(f"{name}={value!r} is not supported by this server")
        return self

    @field_validator("stop")
    @classmethod
    def _stop_bounded(cls, stop: str | list[str] | None) -> str | list[str] | None:
        chars = len(stop) if isinstance(stop, str) else sum(map(len, stop or ()))
        if chars > MAX_STOP_CHARS:
            raise ValueError(f"the stop strings hold {chars} characters, more than the {MAX_STOP_CHARS} allowed")
        return stop

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, salt: str | None) -> str | None:
        if salt is not None and not salt:
            raise ValueError("cache_salt must be a non-empty string")
        return salt

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def asked_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """``SamplingParams`` of this request; ``max_tokens`` is the default when it names none.
        Raises ``ValueError`` naming a bad value."""
        asked = self.asked_max_tokens()
        fields: dict[str, Any] = {"max_tokens": asked if asked is not None else max_tokens,
                                  "ignore_eos": self.ignore_eos}
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.stop is not None:
            fields["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids:
            fields["stop_token_ids"] = tuple(self.stop_token_ids)
        if self.cache_salt is not None and "cache_salt" in SAMPLING_FIELDS:
            fields["cache_salt"] = self.cache_salt
        return SamplingParams(**fields)


# The salt reaches the engine once SamplingParams has the field; until then it is validated only.
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class CompletionRequest(SamplingFields):
    """One prompt: text, token ids, or a list holding exactly one of either."""

    prompt: StrictStr | IntList | StrList | Annotated[list[IntList], _FIRST_ERROR]

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ValueError("one prompt per request: send a string, a list of token ids, or a list of one")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    def prompt_input(self) -> str | list[int]:
        """What the pool encodes: the one prompt, text or token ids."""
        return self.single_prompt()


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | Annotated[list[dict], _FIRST_ERROR] | None = None

    def as_template_input(self) -> dict:
        """The message as the chat template takes it: content parts of type text are joined."""
        content = self.content
        if isinstance(content, list):
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
                raise ValueError("only text content parts are supported")
            content = "".join(part["text"] for part in content)
        return {"role": self.role, "content": content or ""}


class ChatFields(SamplingFields):
    """A chat request's fields but its messages."""

    max_completion_tokens: StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_request_template(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        # A client's own Jinja template runs in the server: one with nested loops would stall
        # every request's tokenizing (vLLM refuses one unless --trust-request-chat-template).
        if kwargs and "chat_template" in kwargs:
            raise ValueError("a request cannot supply its own chat template")
        # What the request's own fields refuse may not reach the template by another way.
        refused = sorted({"tools", "documents"}.intersection(kwargs or ()))
        if refused:
            raise ValueError(f"{', '.join(refused)} in chat_template_kwargs: not supported (no tool calls or "
                             f"documents are served)")
        return kwargs

    def asked_max_tokens(self) -> int | None:
        # OpenAI's successor of max_tokens wins where both are given, as in vLLM.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatCompletionRequest(ChatFields):
    messages: Annotated[list[Message], Field(min_length=1, fail_fast=True)]

    def conversation(self) -> list[dict]:
        return [m.as_template_input() for m in self.messages]

    def prompt_input(self) -> list[dict]:
        """What the pool encodes with the chat template: the messages as plain dicts."""
        return self.conversation()


# Each endpoint's request model and its head (the model less its prompt or messages).
HEADS: dict[type[SamplingFields], type[SamplingFields]] = {
    CompletionRequest: SamplingFields, ChatCompletionRequest: ChatFields,
}
