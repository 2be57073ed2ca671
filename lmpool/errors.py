"""Errors of LMPool's public entry points.

Every refusal of a caller's input is a ``ValueError`` naming the problem, as documented.
An argument of the wrong type raises ``ArgumentTypeError``, which is also a ``TypeError``:
callers may catch either, and code written against the documented ``ValueError`` keeps
working. Bools are never taken as numbers, nor numbers as bools.
"""

from __future__ import annotations

import math
import numbers
import operator


class ArgumentTypeError(TypeError, ValueError):
    """An argument is not of the type the entry point takes; the message names both."""


def type_name(value) -> str:
    return type(value).__name__


def strict_int(value, what: str) -> int:
    """``value`` as an int if it is an integer (numpy's included) but not a bool."""
    if isinstance(value, bool) or type_name(value) == "bool_":
        raise ArgumentTypeError(f"{what} must be an integer, got {value!r} ({type_name(value)})")
    try:
        return operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{what} must be an integer, got {value!r} ({type_name(value)})") from None


def strict_float(value, what: str, *, finite: bool = True) -> float:
    """``value`` as a float if it is a real number (not a bool); NaN always refused, infinity
    unless ``finite`` is False."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{what} must be a number, got {value!r} ({type_name(value)})")
    value = float(value)
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return value


def strict_bool(value, what: str) -> bool:
    """``value`` if it is a Python bool: 1, "yes", None or a numpy bool are refused, so
    that what is accepted here is exactly what every process decodes alike."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{what} must be True or False, got {value!r} ({type_name(value)})")
    return value
