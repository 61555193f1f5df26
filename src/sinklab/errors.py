"""Exceptions sinklab raises for bad input; each message says what was wrong and what to do."""

from __future__ import annotations

import numbers
import operator


def is_int(value) -> bool:
    """Whether an argument is an integer (Python's or NumPy's), and not a bool: ``True`` is not a size."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class SinklabError(Exception):
    """Base class of every error sinklab raises on purpose."""


class UnsupportedModelError(SinklabError):
    """The model's architecture cannot be observed through transformers' public extension points."""


class InputError(SinklabError, ValueError):
    """Texts, lengths, tokenizer or options that cannot produce a meaningful scan."""


def check_int(name: str, value, minimum: int = 0, meaning: str = "") -> int:
    """The one integer check: ``value`` as an ``int`` when it is an integer ≥ ``minimum`` (``True`` is not one), else
    :class:`InputError` "``{name} must be an integer ≥ {minimum}{meaning}, got {value!r}``"."""
    if not is_int(value) or value < minimum:
        raise InputError(f"{name} must be an integer ≥ {minimum}{meaning}, got {value!r}")
    return int(value)


def check_spans(spans, name: str = "pinned", *, overlapping: bool = False) -> list[tuple[int, int]]:
    """The one span check: ``spans``, an iterable of half-open ``(start, end)`` pairs of stream-token indices with
    ``0 ≤ start < end`` (integers, not bools), as a sorted list of int pairs; overlapping spans are refused unless
    ``overlapping``. Else :class:`InputError` naming ``name``."""
    if spans is None:
        return []
    if isinstance(spans, (str, bytes)) or not hasattr(spans, "__iter__"):
        raise InputError(f"{name} is a list of (start, end) pairs of stream-token indices, got {spans!r}")
    out = []
    for item in spans:
        try:  # integers: Python's, NumPy's, 0-d integer tensors (``__index__``); not bools, not floats
            pair = tuple(item)
            if len(pair) != 2 or any(isinstance(x, bool) for x in pair):
                raise TypeError
            start, end = (operator.index(x) for x in pair)
        except (TypeError, ValueError) as exc:
            raise InputError(f"{name} spans are (start, end) pairs of stream-token indices, got {item!r}") from exc
        if start < 0 or end <= start:
            raise InputError(f"{name} span {item!r} must satisfy 0 ≤ start < end (half-open)")
        out.append((start, end))
    out.sort()
    if not overlapping:
        for (a0, a1), (b0, b1) in zip(out, out[1:]):
            if b0 < a1:
                raise InputError(f"{name} spans {(a0, a1)} and {(b0, b1)} overlap")
    return out


class ModelWeightsError(SinklabError, ValueError):
    """The model's weights are unusable (NaN/inf) or do not match its tokenizer."""


class SinklabWarning(UserWarning):
    """A run that works but whose numbers need care (e.g. a model run past its trained positions).

    The command line prints these as one yellow ``warning:`` line.
    """
