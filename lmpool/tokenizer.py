"""Loading a model directory's tokenizer, when it has one, and turning prompts into token ids:
text, token ids as they are, or a chat conversation through the tokenizer's chat template."""

from __future__ import annotations

import contextlib
import numbers
import operator
from pathlib import Path

import msgspec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def load_tokenizer(model_dir: str | Path):
    """The directory's Hugging Face tokenizer, or None if it ships none (token ids only)."""
    path = Path(model_dir)
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of a prompt given as text (needs a tokenizer) or already as token ids (numpy or
    torch integers, and 1-D arrays and tensors, become Python ints; anything else is left for
    validation to name)."""
    if isinstance(prompt, (bytes, bytearray, memoryview, dict)) or prompt is None:  # not ids, not text
        raise ValueError(f"a prompt is text or a sequence of token ids, got {type(prompt).__name__}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model directory has no tokenizer: pass token ids instead of text")
        return tokenizer.encode(check_text(prompt, "the prompt"), add_special_tokens=False)
    if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)):
        # The common case, at C speed (a burst's submissions are serial on one loop): a new list of
        # Python ints, or an error for anything else (bools too), converted or left below.
        with contextlib.suppress(msgspec.ValidationError):
            return msgspec.convert(prompt, list[int])
    try:  # numpy and 0-d torch integers become Python ints; anything else is left for validation to name
        return [operator.index(t) if not isinstance(t, int) and is_token_id(t) else t for t in prompt]
    except TypeError:
        raise ValueError(f"a prompt is text or a sequence of token ids, got {type(prompt).__name__}") from None


def check_text(text: str, what: str) -> str:
    """``text`` if it is valid Unicode: a lone surrogate (JSON's "\\ud800" decodes to one) has no
    UTF-8 form, and the tokenizer fails on it with an unhelpful TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text: {e.reason} at character {e.start}") from None
    return text


def is_token_id(value) -> bool:
    """An integer, not a bool: a Python, numpy or 0-d torch one."""
    if isinstance(value, (bool, str)):
        return False
    if isinstance(value, numbers.Integral):
        return True
    return getattr(value, "ndim", None) == 0 and not getattr(value, "is_floating_point", lambda: True)()


def is_conversation(value) -> bool:
    """A conversation is a list of messages, each a dict (``{"role": ..., "content": ...}``)."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


# The arguments of apply_chat_template that encode_chat sets itself.
# Not template variables: ``encode_chat``'s own arguments, which a template kwarg of the same name
# collided with (a TypeError), and ``apply_chat_template``'s options, which change what it returns
# (token ids, a dict, tensors, a truncated or continued rendering) or what it renders.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "tokenizer", "messages", "conversation", "tokenize", "add_generation_prompt", "continue_final_message",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "processor_kwargs", "sanitize_control_tokens",
})


def encode_chat(tokenizer, messages: list[dict], /, **template_kwargs) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template, ending with the
    assistant's turn opened (``add_generation_prompt``). ``template_kwargs`` reach the
    template (Qwen3's takes ``enable_thinking``)."""
    if tokenizer is None:
        raise ValueError("this model directory has no tokenizer, so it has no chat template: pass token ids")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template: pass text or token ids")
    if not is_conversation(messages):
        raise ValueError(f"a conversation is a non-empty list of message dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise ValueError(f"message {i} needs a 'role' and a 'content' string, got {message!r}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
    if reserved:  # set here; passed twice they were a TypeError
        raise ValueError(f"chat template kwargs cannot set {', '.join(reserved)}")
    from jinja2 import TemplateError

    # Rendered to text, then encoded: the text form returns the same type in every
    # transformers version (the tokenized one became a dict in 5).
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    except TemplateError as e:  # the template refused this conversation (raise_exception) or cannot render
        raise ValueError(f"the chat template failed: {e}") from None
    return tokenizer.encode(check_text(text, "the conversation"), add_special_tokens=False)


def encode_chats(tokenizer, conversations, template_kwargs: dict) -> list[list[int]]:
    """Token ids of one conversation or of a list of them; an error names the conversation."""
    if is_conversation(conversations):
        conversations = [conversations]
    if not isinstance(conversations, list) or not conversations:
        raise ValueError("chat takes a conversation (a list of message dicts) or a non-empty list of them")
    out = []
    for i, messages in enumerate(conversations):
        try:
            out.append(encode_chat(tokenizer, messages, **template_kwargs))
        except ValueError as e:
            raise ValueError(f"conversation {i}: {e}") from None
    return out
