"""The argument checks of :class:`kvoff.scheduler.OffloadingScheduler`'s hooks (one job): token
counts, job reports, the scheduler's size arguments and offload keys, each refused with an error
that names the bad value before the C++ core sees it (so a bad call changes nothing).
"""

from __future__ import annotations

import operator
from typing import Any

__all__ = ["check_count", "job_report", "key_bytes", "not_a", "token_count"]


def token_count(name: str, value: Any) -> int:
    """``value`` as a token count the core takes (a 64-bit int), or an error naming ``name``.

    Raises:
        TypeError: not an int (a float, None, a bool).
        ValueError: outside the 64-bit range.
    """
    if type(value) is int and -(2**63) <= value < 2**63:  # the engine's case: no work
        return value
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int number of tokens, got {value!r}")
    v = operator.index(value)
    if not -(2**63) <= v < 2**63:
        raise ValueError(f"{name}={v} does not fit in 64 bits; pass a token count")
    return v


def job_report(item: Any) -> tuple[int, bool]:
    """``(job_id, success)`` of one job report, checked: a report the scheduler would
    misread (a string ``"False"`` taken as success, a float id truncated to another job) is
    refused, naming the value."""
    if isinstance(item, tuple):
        if len(item) != 2:
            raise ValueError(f"report {item!r} must be a (job_id, success) pair")
        job_id, success = item
    else:
        try:
            job_id, success = item.job_id, item.success
        except AttributeError:
            raise TypeError(
                f"report {item!r} ({type(item).__name__}) must be a JobReport, a "
                "(job_id, success) tuple or an object with job_id and success"
            ) from None
    if isinstance(job_id, bool) or not hasattr(job_id, "__index__"):
        raise TypeError(f"job_id={job_id!r} in report {item!r} must be an int")
    if type(success).__name__ not in ("bool", "bool_"):  # bool or numpy.bool_
        raise TypeError(f"success={success!r} in report {item!r} must be a bool")
    return operator.index(job_id), bool(success)


def check_count(name: str, value: object, low: int, high: int, shown: str, what: str) -> None:
    """Raises ValueError naming ``name`` unless ``value`` is an int (not a bool) in
    ``[low, high]``; ``shown`` is the range as the message gives it, ``what`` its unit."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}={value!r} must be an int in {shown} ({what})")


def key_bytes(key: bytes | int) -> bytes:
    """An offload key as the manager stores it: bytes as they are, an int as 8 little-endian
    bytes (the C++ manager's encoding).

    Raises:
        TypeError, ValueError: ``key`` is not non-empty bytes or a 64-bit int.
    """
    if isinstance(key, int) and not isinstance(key, bool):
        if not -(2**63) <= key < 2**64:
            raise ValueError(f"key {key} is outside [-2**63, 2**64)")
        return (key % 2**64).to_bytes(8, "little")
    if not isinstance(key, (bytes, bytearray, memoryview)) or not bytes(key):
        raise TypeError(f"a key is non-empty bytes or a 64-bit int, not {key!r}")
    return bytes(key)


def not_a(what: str, needs: str, value: object, error: AttributeError) -> TypeError:
    """The error for an argument that lacks an attribute the hook reads (``error``, raised
    while reading it, before anything changed): it names the argument, what it must have and
    what it is."""
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return TypeError(
        f"{what} must have {needs}, got {type(value).__name__} {shown} ({error}); nothing was "
        "changed"
    )
