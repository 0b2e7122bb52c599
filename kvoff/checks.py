"""Argument checks shared by kvoff's public constructors (one job): flags, which
``bool(value)`` would misread, are refused naming the argument before anything is made.
"""

from __future__ import annotations

import numpy as np

__all__ = ["check_flag", "is_flag"]


def is_flag(value: object) -> bool:
    """Whether ``value`` is a bool: Python's, or numpy's bool scalar (``numpy.bool_``), which
    array code hands back; nothing else, whatever ``bool(value)`` would say."""
    return value.__class__ is bool or value.__class__ is np.bool_


def check_flag(name: str, value: object, *, none_ok: bool = False) -> None:
    """Raises TypeError naming ``name`` unless ``value`` is a bool (Python's or numpy's bool
    scalar; None too with ``none_ok``): ``bool(value)`` would read None, 0, "no" or "False"
    as a flag and silently turn a feature on or off."""
    if is_flag(value) or (none_ok and value is None):
        return
    also = ", or None for the default" if none_ok else ""
    raise TypeError(
        f"{name} must be a bool (True or False{also}), got {type(value).__name__} ({value!r})"
    )
