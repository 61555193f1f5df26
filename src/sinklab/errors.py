"""Exceptions sinklab raises for bad input; each message says what was wrong and what to do."""

from __future__ import annotations

import numbers


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


class ModelWeightsError(SinklabError, ValueError):
    """The model's weights are unusable (NaN/inf) or do not match its tokenizer."""


class SinklabWarning(UserWarning):
    """A run that works but whose numbers need care (e.g. a model run past its trained positions).

    The command line prints these as one yellow ``warning:`` line.
    """
