"""OpenAI request bodies for ``/v1/completions`` and ``/v1/chat/completions``, and their
translation into ``SamplingParams``.

Unknown fields are accepted and ignored, as vLLM and SGLang do: clients and gateways send
fields (``user``, ``metadata``...) that a server may not act on. But a field of OpenAI's or
vLLM's API that would change the output (``logit_bias``, ``best_of``, ``tools``...) is
refused unless it holds its no-op value (``UNSUPPORTED``): ignoring it would answer something
other than what was asked. ``n``, ``logprobs`` (completions: how many alternatives; chat: a
bool, with ``top_logprobs``), ``echo`` (completions), the three penalties and a list of
prompts (completions) are served. Every field that is acted on is validated here or by
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
from typing import Annotated, Any, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from lmpool.sampling_params import SamplingParams
from lmpool.token_logprobs import MAX_LOGPROBS

# OpenAI's default for /v1/completions.
DEFAULT_COMPLETION_TOKENS = 16
# The most choices one request may ask for (``n``; a list of prompts multiplies them): each is a
# request of its own in the pool.
MAX_CHOICES = 128

# Fields of OpenAI's and vLLM's requests that this server does not implement, each with the
# values that leave the output as it is (what clients send as defaults); any other is refused.
# Only fields a request model does not declare are checked (an endpoint that serves one declares it).
UNSUPPORTED: dict[str, tuple] = {
    # echo is a completion field, top_logprobs a chat one; vLLM's chat echo (of the last message) is not served.
    "best_of": (None, 1), "suffix": (None, ""), "prompt_logprobs": (None,), "echo": (None, False),
    "top_logprobs": (None, 0),
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
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
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
    def _choices_bounded(cls, n: int | None) -> int | None:
        if n is not None and not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {n}")
        return n

    @property
    def num_choices(self) -> int:
        return self.n or 1

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
        for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        fields.update(self.logprob_fields())
        if self.stop is not None:
            fields["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids:
            fields["stop_token_ids"] = tuple(self.stop_token_ids)
        if self.cache_salt is not None and "cache_salt" in SAMPLING_FIELDS:
            fields["cache_salt"] = self.cache_salt
        return SamplingParams(**fields)

    def logprob_fields(self) -> dict[str, int]:
        """``SamplingParams``' logprob settings this request asks for (each endpoint's own)."""
        return {}


# The salt reaches the engine once SamplingParams has the field; until then it is validated only.
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class CompletionFields(SamplingFields):
    """A completion request's fields but its prompt."""

    # A number of alternatives per token (0: the token's own logprob); false or null: none.
    logprobs: StrictInt | StrictBool | None = None
    echo: StrictBool | None = False

    @field_validator("logprobs")
    @classmethod
    def _logprobs_count(cls, value: int | bool | None) -> int | None:
        if value is True:
            raise ValueError("logprobs of a completion is a number of alternatives per token "
                             f"(0 to {MAX_LOGPROBS}), not true")
        if value is False or value is None:
            return None
        if not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {value}")
        return value

    @model_validator(mode="after")
    def _echo_only_for_no_tokens(self):
        # max_tokens 0 asks for the prompt's logprobs alone (a loglikelihood request): only with echo.
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 is allowed only with echo, for the prompt alone)")
        return self

    def asked_max_tokens(self) -> int | None:
        # No tokens asked (echo's prompt alone): the pool runs one, which the response leaves out.
        return 1 if self.max_tokens == 0 else self.max_tokens

    @property
    def prompt_only(self) -> bool:
        return self.max_tokens == 0

    def logprob_fields(self) -> dict[str, int]:
        if self.logprobs is None:
            return {}
        # Echoed with logprobs: the prompt's too, as many alternatives (as vLLM).
        return {"logprobs": self.logprobs, **({"prompt_logprobs": self.logprobs} if self.echo else {})}


class PromptList(list):
    """Several prompts of one completion request (each text or token ids), told apart from one
    prompt of token ids."""


class CompletionRequest(CompletionFields):
    """A prompt (text or token ids) or a list of prompts."""

    prompt: StrictStr | IntList | StrList | Annotated[list[IntList], _FIRST_ERROR]

    def prompt_input(self) -> str | list[int] | PromptList:
        """What the pool encodes: the one prompt, text or token ids, or a ``PromptList``."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) * self.num_choices > MAX_CHOICES:
                raise ValueError(f"{len(prompt)} prompts times n={self.num_choices} is more than the "
                                 f"{MAX_CHOICES} choices one request may ask for")
            if any(not p for p in prompt):
                raise ValueError(f"prompt {[bool(p) for p in prompt].index(False)} is empty")
            return PromptList(prompt) if len(prompt) > 1 else prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return cast(str | list[int], prompt)  # one prompt: a list of them went above


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


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """A request's ``chat_template_kwargs``, refused where they would do what the request's own fields may not."""
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


class ChatFields(SamplingFields):
    """A chat request's fields but its messages."""

    max_completion_tokens: StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self):
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
            if self.top_logprobs and not self.logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprob_fields(self) -> dict[str, int]:
        return {"logprobs": self.top_logprobs or 0} if self.logprobs else {}

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        return template_kwargs(kwargs)

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


class TokenizeFields(BaseModel):
    """``/tokenize``'s fields but its prompt or messages (vLLM's)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("add_generation_prompt")
    @classmethod
    def _as_chat_requests_render(cls, value: bool) -> bool:
        if not value:
            raise ValueError("add_generation_prompt=false is not supported: a conversation is rendered with the "
                             "assistant's turn opened, as chat requests are")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        return template_kwargs(kwargs)


class TokenizeRequest(TokenizeFields):
    """Text (or a conversation, rendered with the chat template) to tokenize."""

    prompt: StrictStr | None = None
    messages: Annotated[list[Message], Field(min_length=1, fail_fast=True)] | None = None

    def prompt_input(self) -> str | list[dict]:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either a prompt or messages")
        if self.messages is None:
            assert self.prompt is not None  # one of the two, checked above
            return self.prompt
        return [m.as_template_input() for m in self.messages]


class DetokenizeFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None


class DetokenizeRequest(DetokenizeFields):
    tokens: IntList

    def prompt_input(self) -> list[int]:
        return self.tokens


# A request model of one of the endpoints that take a body with a prompt or messages.
RequestModel = CompletionRequest | ChatCompletionRequest | TokenizeRequest | DetokenizeRequest

# Each endpoint's request model and its head (the model less its prompt or messages).
HEADS: dict[type[BaseModel], type[BaseModel]] = {
    CompletionRequest: CompletionFields, ChatCompletionRequest: ChatFields, TokenizeRequest: TokenizeFields,
    DetokenizeRequest: DetokenizeFields,
}
