"""Checks for the fields of plain data (plans, cluster specs), as constructed or read back from JSON.

Each check takes a value and its field path (``stages[1].inputs[3].shape``), returns the value as the
dataclass stores it (lists become tuples), and raises ``ValueError`` naming the path, what was expected and
what it got::

    >>> ints([2, "abc"], "stages[1].inputs[3].shape")
    Traceback (most recent call last):
    ...
    ValueError: stages[1].inputs[3].shape[1]: expected an int >= 0, got "abc"

Nothing here needs JAX.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

_SHOWN_CHARS = 60
_INT_LIMIT = 2**63
"""Ints are below it (the largest int64 + 1): byte counts and ids that a computation can still use."""
_FLOAT_MAX = sys.float_info.max


def describe(value: Any) -> str:
    """A short JSON-like rendering of ``value`` for an error message (containers cut at a few characters)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 3] + "..."


def invalid(at: str, expected: str, value: Any) -> ValueError:
    """The error for a field at path ``at`` whose value is not what was expected."""
    return ValueError(f"{at}: expected {expected}, got {describe(value)}")


def join(at: str, name: str) -> str:
    """The path of field ``name`` inside the object at path ``at`` (``""`` is the root)."""
    return f"{at}.{name}" if at else name


def is_int(value: Any) -> bool:
    """An integer that is not a bool (JSON's ``true`` is not a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def integer(value: Any, at: str, minimum: int = 0) -> int:
    """An int ``>= minimum`` (and below 2**63)."""
    if not is_int(value) or value < minimum:
        raise invalid(at, f"an int >= {minimum}", value)
    if value >= _INT_LIMIT:
        raise invalid(at, "an int below 2**63", value)
    return int(value)


def number(value: Any, at: str, positive: bool = False) -> float:
    """A finite number ``>= 0`` (``> 0`` if ``positive``: seconds, FLOPs, bandwidths) that a float can hold,
    returned as given (an int stays an int)."""
    if not is_number(value) or not 0 <= value <= _FLOAT_MAX or (positive and value == 0):  # NaN compares False
        raise invalid(at, f"a finite number {'>' if positive else '>='} 0", value)
    return value


def string(value: Any, at: str) -> str:
    if not isinstance(value, str):
        raise invalid(at, "a string", value)
    return value


def boolean(value: Any, at: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(at, "true or false", value)
    return value


def choice(value: Any, at: str, choices: Collection[Any]) -> Any:
    """One of the strings ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise invalid(at, f"one of {list(choices)}", value)
    return value


def optional(check: Callable[..., Any]) -> Callable[..., Any]:
    """``check`` that lets ``None`` (JSON's ``null``) through."""
    def check_or_none(value: Any, at: str, *args: Any, **kwargs: Any) -> Any:
        return None if value is None else check(value, at, *args, **kwargs)
    return check_or_none


def sequence(value: Any, at: str, item: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """A JSON list, each element checked by ``item(element, f"{at}[{i}]", *args, **kwargs)``."""
    if not isinstance(value, (list, tuple)):
        raise invalid(at, "a list", value)
    return tuple(item(x, f"{at}[{i}]", *args, **kwargs) for i, x in enumerate(value))


def ints(value: Any, at: str, minimum: int = 0, lengths: Collection[int] | None = None) -> tuple[int, ...]:
    """A list of ints ``>= minimum`` whose length, with ``lengths`` given, is one of them."""
    if not isinstance(value, (list, tuple)) or (lengths is not None and len(value) not in lengths):
        count = "" if lengths is None else " or ".join(map(str, sorted(lengths))) + " "
        raise invalid(at, f"a list of {count}ints >= {minimum}", value)
    return sequence(value, at, integer, minimum)


def reader(cls: type, value: Any, at: str) -> Callable[..., Any]:
    """Checks that ``value`` is a JSON object with the fields of dataclass ``cls`` (every field without a
    default present, no other key) and returns ``get(name, check, *args)``: the field ``name`` checked by
    ``check(value, path, *args)``, or the field's default when the object leaves it out.

    >>> @dataclasses.dataclass
    ... class Point:
    ...     x: int
    ...     label: str = ""
    >>> get = reader(Point, {"x": 3}, "points[0]")
    >>> get("x", integer), get("label", string)
    (3, '')
    >>> reader(Point, {"x": 3, "y": 4}, "points[0]")
    Traceback (most recent call last):
    ...
    ValueError: points[0]: unknown keys ['y'] (known: ['label', 'x'])
    """
    if not isinstance(value, Mapping):
        raise invalid(at or cls.__name__, f"a JSON object (a {cls.__name__})", value)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in value if k not in fields)
    if unknown:
        raise ValueError(f"{at or cls.__name__}: unknown keys {unknown} (known: {sorted(fields)})")
    missing = sorted(name for name, f in fields.items() if name not in value and _default(f) is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{at or cls.__name__}: missing keys {missing}")

    def get(name: str, check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if name not in value:
            return _default(fields[name])
        return check(value[name], join(at, name), *args, **kwargs)
    return get


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING
