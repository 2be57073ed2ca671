"""Decoding a request body into its request model, and the process that does it for large bodies.

``decode`` turns a body into a request model exactly as FastAPI did for a body parameter: JSON
when the content type says so, validated by pydantic; a failure is ``BodyInvalid``, whose
message is the one FastAPI's error gave (``lmpool.frontend.serve.errors``): "FIELD: MSG" joined
by "; ", "POS: JSON decode error", "Field required" for an empty body. The model comes
``resolved()`` (its prompt or conversation already extracted), and its unknown fields, validated,
are dropped: nothing reads them afterwards, and a body of junk fields then costs whoever receives
the model nothing.

Run as a script (``python -P body_worker.py``), this module is the server's body-parsing process.
Neither ``json``, ``msgspec`` nor pydantic releases the GIL while it builds Python objects, so a
thread would not help: a 32 MiB body is seconds of decoding and validation, which in the server
process pause every other request's stream. The process reads requests from stdin and writes one
answer per request to stdout, in order:

- request: 8-byte big-endian length, a pickle of ``(model class, content type)`` (or of None, a
  ping, answered ``OK`` and nothing once the process is ready), then 8-byte length and the body;
- answer: 8-byte length, then one byte ``OK`` and the model as ``pack`` writes it, or
  ``INVALID`` / ``FAILED`` and a UTF-8 message.

``pack`` pickles the model with every list or dict of more than ``PIECE`` items, and every
string of more than ``STR_PIECE`` characters, in pieces of their own, which ``unpack`` rebuilds
one at a time, releasing the GIL between them: the server process receives even a model of
millions of items, or a 32 MiB prompt, without holding its event loop for more than a piece
(decoding a 32 MiB string at once held it 40 ms). The peer of these pickles is only ever this
module's own process, started by the server.

The process imports the standard library, pydantic and the request models only: the ``lmpool``
package's ``__init__`` (which loads the engine, and torch) is not run. It dies with its parent
(``PR_SET_PDEATHSIG``) and exits at the end of its stdin.
"""

from __future__ import annotations

import email.message
import gc
import io
import json
import pickle
import sys
import time
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

OK, INVALID, FAILED = b"o", b"i", b"f"
PIECE = 512  # items per piece: under a millisecond to unpickle, for the conversations decode gives
STR_PIECE = 1 << 20  # characters per piece of a long string: about a millisecond to decode
_LIST, _DICT, _STR = 0, 1, 2
_MISSING = object()
_PARSE_ERROR = "There was an error parsing the body"  # FastAPI's, for a body json cannot read


class BodyInvalid(Exception):
    """A body its request model refuses; the message is the 400's."""


def decode(model: type[BaseModel], content_type: str | None, body: bytes) -> BaseModel:
    """The request model of ``body``, or ``BodyInvalid``; as FastAPI decodes a body parameter."""
    value: Any = _MISSING
    if body:
        value = body  # not JSON by its content type: validated as bytes, which a model refuses
        if _is_json(content_type):
            try:
                value = json.loads(body)
            except json.JSONDecodeError as e:
                raise BodyInvalid(f"{e.pos}: JSON decode error") from None
            except Exception:  # not UTF-8, nested past the recursion limit...
                raise BodyInvalid(_PARSE_ERROR) from None
    if value is _MISSING:
        raise BodyInvalid("Field required")
    try:
        request = _adapter(model).validate_python(value, from_attributes=True)
    except ValidationError as e:
        raise BodyInvalid(validation_message(e.errors(include_url=False))) from None
    request = request.resolved() if hasattr(request, "resolved") else request
    _forget_extras(request)
    return request


def validation_message(errors: list[dict], skip: tuple = ()) -> str:
    """pydantic's errors as one line: "FIELD.PATH: MSG" joined by "; " (``skip``: location
    parts to leave out, such as FastAPI's "body")."""
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p not in skip)
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def _is_json(content_type: str | None) -> bool:
    # FastAPI's test: application/json or application/*+json; no content type is not JSON.
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


_ADAPTERS: dict[type, TypeAdapter] = {}


def _adapter(model: type[BaseModel]) -> TypeAdapter:
    if model not in _ADAPTERS:
        _ADAPTERS[model] = TypeAdapter(model)
    return _ADAPTERS[model]


def _forget_extras(model: BaseModel) -> None:
    if model.__pydantic_extra__:
        object.__setattr__(model, "__pydantic_extra__", {})
    for value in model.__dict__.values():
        if isinstance(value, BaseModel):
            _forget_extras(value)
        elif type(value) is list and value and isinstance(value[0], BaseModel):  # validated lists are uniform
            for item in value:
                _forget_extras(item)


class _Packer(pickle.Pickler):
    def persistent_id(self, obj):
        if type(obj) is list and len(obj) > PIECE:
            return _LIST, len(obj), tuple(pack(obj[i:i + PIECE]) for i in range(0, len(obj), PIECE))
        if type(obj) is dict and len(obj) > PIECE:
            items = list(obj.items())
            return _DICT, len(items), tuple(pack(items[i:i + PIECE]) for i in range(0, len(items), PIECE))
        if type(obj) is str and len(obj) > STR_PIECE:
            return _STR, len(obj), tuple(pack(obj[i:i + STR_PIECE]) for i in range(0, len(obj), STR_PIECE))
        return None


class _Unpacker(pickle.Unpickler):
    def persistent_load(self, pid):
        kind, size, pieces = pid
        # Items go into a list of their final size: growing one of millions reallocates it,
        # tens of milliseconds of copying at a time.
        parts: list = [None] * (len(pieces) if kind == _STR else size)
        at = 0
        for i, piece in enumerate(pieces):
            part = _Unpacker(io.BytesIO(piece)).load()
            if kind == _STR:
                parts[i] = part
            else:
                parts[at:at + len(part)] = part
                at += len(part)
            time.sleep(0)  # hands the GIL to the event loop's thread, should it be waiting
        return parts if kind == _LIST else dict(parts) if kind == _DICT else "".join(parts)


def pack(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Packer(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    """The object ``pack`` wrote; in the server process, on a thread of its own (``body``)."""
    # No collection while it is rebuilt: each would traverse the lists being built (a 4M-id
    # prompt's list is 4M slots, 50-130 ms of a held GIL every time).
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _Unpacker(io.BytesIO(data)).load()
    finally:
        if collecting:
            gc.enable()


def answer(model: type[BaseModel], content_type: str | None, body: bytes) -> tuple[bytes, bytes]:
    """The process's answer to one request: its kind and payload."""
    gc.disable()  # the objects decoded hold no cycles; collecting them on the way costs 2-4x
    try:
        return OK, pack(decode(model, content_type, body))
    except BodyInvalid as e:
        return INVALID, str(e).encode()
    except Exception as e:  # a bug, or an exhausted process: this request fails, not the process
        return FAILED, f"{type(e).__name__}: {e}".encode()
    finally:
        gc.enable()


def _read(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError
    return data


def _serve(stdin, stdout) -> None:
    while True:
        try:
            meta = _read(stdin, int.from_bytes(_read(stdin, 8), "big"))
            body = _read(stdin, int.from_bytes(_read(stdin, 8), "big"))
        except EOFError:  # the server closed its end: done
            return
        request = pickle.loads(meta)
        kind, payload = (OK, b"") if request is None else answer(*request, body)
        stdout.write((len(payload) + 1).to_bytes(8, "big") + kind)
        stdout.write(payload)
        stdout.flush()


def _main() -> None:
    import ctypes
    import os
    import signal
    import types
    from pathlib import Path

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server
    if os.getppid() == 1:  # the server died before prctl took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    # The lmpool package without its __init__: the request models need none of the engine.
    package = types.ModuleType("lmpool")
    package.__path__ = [str(Path(__file__).resolve().parents[2])]
    sys.modules["lmpool"] = package
    import lmpool.frontend.serve.protocol  # noqa: F401  (the models' classes, for the requests' pickles)

    gc.freeze()  # what is loaded now stays: later collections need not look at it
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the answers
    _serve(stdin, stdout)


if __name__ == "__main__":
    _main()
