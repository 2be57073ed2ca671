"""pydantic's validation errors in the words of OpenAI's API: a sentence naming the field.

``described(errors)`` turns a ``ValidationError``'s errors into ``(message, param)``: the
message says what is wrong with which field, as OpenAI's API says it ("Missing required
parameter: 'messages'.", "Invalid type for 'max_tokens': expected an integer.") and never in
pydantic's own terms (no "Value error, ", no union member names such as ``list[int]``, no
"Input should be"); ``param`` is the field as OpenAI's error body names it (``messages[0].content``),
or None for the body as a whole.

A field whose type is a union fails once per member; those errors are one sentence listing what
the field may be. Inputs are not read (a prompt of millions of ids would be copied to name its
type), so a message says what was expected, not what came.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

# What an error of these pydantic types expected, as JSON names it.
EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "string_type": "a string",
    "bool_type": "a boolean", "bool_parsing": "a boolean", "list_type": "an array", "tuple_type": "an array",
    "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
    "none_required": "null",
}
SCALARS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean", "none": "null"}
PLURAL = {"str": "strings", "int": "integers", "float": "numbers", "bool": "booleans", "none": "nulls"}
# A location part naming a union member rather than a field: a type (``str``, ``list[int]``,
# ``function-after[...]``) or a model class; OpenAI's fields are lowercase words.
_MEMBER = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\]|[A-Z]\w*)$")


def described(errors: Sequence[Mapping[str, Any]], skip: tuple = ()) -> tuple[str, str | None]:
    """The client's message for ``errors`` (pydantic's, location parts in ``skip`` left out:
    FastAPI's "body"), and the ``param`` of the first failing field."""
    groups: dict[tuple, list[tuple[str | None, Mapping[str, Any]]]] = {}
    for err in errors:
        path, member = _split([p for p in err.get("loc", ()) if p not in skip])
        groups.setdefault(path, []).append((member, err))
    sentences = [_sentence(path, group) for path, group in groups.items()]
    return " ".join(sentences) or "Invalid request.", _param(next(iter(groups), ())) or None


def _split(loc: list) -> tuple[tuple, str | None]:
    """A location as the field's path and the union member it failed in (None: no union)."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and _MEMBER.match(part):
            return tuple(loc[:i]), part
    return tuple(loc), None


def _param(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _sentence(path: tuple, group: list[tuple[str | None, Mapping[str, Any]]]) -> str:
    param = _param(path)
    members = [m for m, _ in group if m is not None]
    if members:  # a union: every member failed
        return f"Invalid type for '{param}': expected {_any_of(dict.fromkeys(members))}."
    return _one(param, group[0][1])


def _one(param: str, err: Mapping[str, Any]) -> str:
    kind, ctx = err.get("type", ""), err.get("ctx") or {}
    if kind == "json_invalid":
        detail = str(ctx.get("error") or err.get("msg", "")).removeprefix("Invalid JSON: ")
        return f"The request body is not valid JSON ({detail})."
    if kind == "missing":
        return f"Missing required parameter: '{param}'."
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}."
    if kind == "value_error" and "error" in ctx:  # a validator's own words, without pydantic's "Value error, "
        reason = str(ctx["error"])
        return f"Invalid value for '{param}': {reason}." if param else _ended(reason)
    if kind in EXPECTED:
        expected = EXPECTED[kind]
        return f"Invalid type for '{param}': expected {expected}." if param else \
            f"The request body must be {'a JSON object' if expected == 'an object' else expected}."
    if kind == "literal_error" and "expected" in ctx:
        return f"Invalid value for '{param}': expected {ctx['expected']}."
    if kind == "too_short" and "min_length" in ctx:
        return f"Invalid value for '{param}': expected at least {ctx['min_length']} item(s)."
    if kind == "too_long" and "max_length" in ctx:
        return f"Invalid value for '{param}': expected at most {ctx['max_length']} item(s)."
    return f"Invalid value for '{param}': {_lowered(str(err.get('msg', 'invalid')))}." if param else \
        _ended(str(err.get("msg", "Invalid request")))


def _any_of(members) -> str:
    names = [_member(m) for m in members]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _member(tag: str, plural: bool = False) -> str:
    """A union member's tag as JSON names its values: ``list[int]`` is "an array of integers"
    (``plural``: "arrays of integers")."""
    inner = re.fullmatch(r"list\[(.*)\]", tag)
    if inner:
        return f"{'arrays' if plural else 'an array'} of {_member(inner.group(1), plural=True)}"
    if tag in SCALARS:
        return PLURAL[tag] if plural else SCALARS[tag]
    if tag.startswith("dict[") or tag[:1].isupper():
        return "objects" if plural else "an object"
    return f"'{tag}'"


def _lowered(text: str) -> str:
    return text[:1].lower() + text[1:]


def _ended(text: str) -> str:
    return text if text.endswith(".") else text + "."
