"""The argument checks of :class:`kvoff.scheduler.OffloadingScheduler`'s hooks (one job): token
counts, job reports, the scheduler's size arguments and offload keys, each refused with an error
that names the bad value before the C++ core sees it (so a bad call changes nothing).
"""

from __future__ import annotations

import operator
from typing import Any

from kvoff.checks import check_flag, is_flag

__all__ = [
    "check_count",
    "check_scheduler_args",
    "job_report",
    "key_bytes",
    "not_a",
    "token_count",
]


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
    if not is_flag(success):
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


def check_scheduler_args(
    num_cpu_blocks: int,
    num_gpu_blocks: int,
    *,
    enable_events: Any,
    store_batch_blocks: Any,
    offload_prompt_only: Any,
    store_threshold: Any,
    max_tracker_size: Any,
    node_pool: Any,
) -> None:
    """The checks of :class:`kvoff.scheduler.OffloadingScheduler`'s constructor arguments, before
    anything is made (its docstring gives the ranges): the CPU pool's size in offloaded blocks
    (``num_cpu_blocks``, 1 to 2**31 - 1), the node pool's slot count against it, the two flags
    and the three counts.

    Raises:
        TypeError: a flag that is not a bool.
        ValueError: a count out of range or a pool size that does not fit, naming it.
    """
    check_flag("enable_events", enable_events)
    check_flag("offload_prompt_only", offload_prompt_only)
    check_count(
        "store_batch_blocks",
        store_batch_blocks,
        1,
        1 << 20,
        "[1, 2**20]",
        "offloaded blocks; 1 stores every block as it fills",
    )
    check_count(
        "store_threshold",
        store_threshold,
        0,
        1 << 20,
        "[0, 2**20]",
        "offers; 0 or 1 stores every block, n >= 2 stores a block once it was offered n times",
    )
    check_count(
        "max_tracker_size",
        max_tracker_size,
        1 if store_threshold >= 2 else 0,
        2**31 - 1,
        "[1, 2**31 - 1]",
        "keys whose offers store_threshold counts; default 64000",
    )
    if num_cpu_blocks > 2**31 - 1:
        raise ValueError(
            f"the CPU pool has {num_cpu_blocks} blocks; at most 2**31 - 1 are supported: "
            "lower cpu_bytes_to_use"
        )
    if num_cpu_blocks < 1:
        raise ValueError(
            f"the CPU pool has {num_cpu_blocks} blocks (num_gpu_blocks={num_gpu_blocks}); give "
            "the engine GPU blocks and cpu_bytes_to_use for at least one offloaded block"
        )
    if node_pool is not None and node_pool.num_slots != num_cpu_blocks:
        raise ValueError(
            f"the node pool at {node_pool.socket_path} has {node_pool.num_slots} slots but "
            f"the spec has {num_cpu_blocks} CPU blocks; give the spec the pool's slots"
        )
