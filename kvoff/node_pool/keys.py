"""An engine's offload keys on their way to the node pool (one job): the checks and the
conversion of :class:`kvoff.node_pool.client.NodePoolClient`'s key arguments, so that a bad
key is refused with an error that names it, before anything is sent (``bytes(5)`` would be
five zero bytes: a key of another block)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvoff.node_pool import protocol as p

__all__ = ["as_bytes", "checked_key", "checked_keys", "reused_flags"]


def as_bytes(keys: Sequence[bytes]) -> list[bytes]:
    """``keys`` as a list of bytes: as given when it looks like one (the scheduler's calls: no
    copy of 200 keys a step; the C++ side refuses a later key that is neither bytes nor an int,
    and takes an int as 8 bytes, as the manager does), else checked and converted
    (:func:`checked_keys`)."""
    if type(keys) is list and (not keys or type(keys[0]) is bytes):
        return keys
    return checked_keys(keys)


_MAX_OWN_KEY = p.MAX_KEY_BYTES - 8
"""The longest key an engine may use: the pool's limit less the 8-byte layout prefix."""


def checked_key(key: object, where: str = "key") -> bytes:
    """``key`` (bytes, bytearray or memoryview) as bytes.

    Raises:
        TypeError: not bytes-like (an int, a str, None: ``bytes(5)`` would be 5 zero bytes).
        ValueError: empty, or longer than the pool allows with the layout prefix.
    """
    if not isinstance(key, (bytes, bytearray, memoryview)):
        shown = repr(key)
        raise TypeError(
            f"{where} must be bytes (an offload key), got {type(key).__name__} {shown[:60]}"
        )
    b = bytes(key)
    if not 0 < len(b) <= _MAX_OWN_KEY:
        raise ValueError(f"{where} is {len(b)} bytes; offload keys are 1..{_MAX_OWN_KEY} bytes")
    return b


def checked_keys(keys: object) -> list[bytes]:
    """``keys`` (a list or tuple of keys) as a list of bytes, each :func:`checked_key`.

    Raises:
        TypeError: ``keys`` is not a list or tuple (a single key, None), or a key is not
            bytes-like.
        ValueError: an empty or too long key.
    """
    ks: Any = keys
    if ks.__class__ in (list, tuple) and all(
        k.__class__ is bytes and 0 < len(k) <= _MAX_OWN_KEY for k in ks
    ):  # the engines' case, checked at once (5 us for 100 keys, 27 us key by key)
        return list(ks)
    if not isinstance(keys, (list, tuple)):
        raise TypeError(
            f"keys must be a list or tuple of offload keys (bytes), got {type(keys).__name__}; "
            "wrap a single key in a list"
        )
    return [checked_key(k, f"keys[{i}]") for i, k in enumerate(keys)]


def reused_flags(reused: Any, num_keys: int) -> bytes:
    """A touch's ``reused`` argument as one byte per key (nonzero: a reuse): ``None`` gives
    none, bytes are taken as they are, a sequence of bools is converted.

    Raises:
        TypeError: ``reused`` is not None, bytes or a sequence.
        ValueError: not one flag per key (the pool would refuse the touch, after the fact).
    """
    if reused is None:
        return b""
    if isinstance(reused, bytes):  # one byte per key already (the scheduler's)
        flags = reused
    else:
        try:
            flags = bytes(1 if r else 0 for r in reused)
        except TypeError:
            raise TypeError(
                f"reused must be a sequence of bools, one per key, or bytes, got "
                f"{type(reused).__name__}"
            ) from None
    if len(flags) != num_keys:
        raise ValueError(
            f"touch of {num_keys} keys with {len(flags)} reused flags; give one flag per key, "
            "or none"
        )
    return flags
