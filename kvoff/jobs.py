"""Jobs: the block specs a job copies between and the record of what became of it.

A job moves blocks of one request between the engine's GPU KV cache and the CPU pool: a store
(:class:`GPUBlockSpec` → :class:`CPUBlockSpec`) or a load (the reverse). The scheduler builds
them (:class:`kvoff.scheduler.TransferJob`), the worker (:class:`kvoff.OffloadingWorker`) runs
them and answers one :class:`TransferResult` per job.

These are plain values, shared by both sides: this module needs neither torch nor kvoff's
compiled ops, so the scheduler (which may run in a process without a GPU) never imports the
worker. The underscore helpers (``_trusted``, ``_job_id``, ``_sides``, ``_is_index``) are for the
scheduler and the worker inside kvoff, not API.
"""

from __future__ import annotations

import contextlib
import operator
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvoff.transfer import Direction

__all__ = ["CPUBlockSpec", "GPUBlockSpec", "TransferResult"]

_T = TypeVar("_T")

_MAX_ID = 2**63 - 1
"""The largest id or count a job may hold: ids travel as int64 (numpy, the copy ops, the core)."""


_NONE = object()


def _int_tuple(name: str, values: Iterable[int]) -> tuple[int, ...]:
    """``values`` as a tuple of ints in ``[0, 2**63)`` (numpy integers accepted).

    Raises:
        TypeError: a str, bytes, set or dict (ids must come in a fixed order), or an item that
            is not an integer (1.9, "3", True or a tensor of floats are not ids).
        ValueError: a negative value, or one of 2**63 or more (ids are int64 everywhere).
    """
    if isinstance(values, (str, bytes, set, frozenset, dict)):
        raise TypeError(
            f"{name} must be an ordered sequence of ints (a tuple, a list or a 1-D integer "
            f"array), got {type(values).__name__} {values!r}"
        )
    try:
        items = list(values)
    except TypeError:
        raise TypeError(
            f"{name} must be a sequence of ints, got {type(values).__name__} {values!r}"
        ) from None
    if _is_bool(values):
        raise TypeError(
            f"{name} must hold ints, got a tensor or array of bools ({values!r}); pass the "
            "integer ids, not a mask (e.g. mask.nonzero())"
        )
    try:
        out = tuple(map(operator.index, items))
        bad = next((v for v in items if v.__class__ is not int and _is_bool(v)), _NONE)
    except TypeError:
        bad = next((v for v in items if not _is_index(v)), values)
    if bad is not _NONE:  # a sentinel: None itself is a bad item
        raise TypeError(
            f"{name} must hold ints, got {bad!r} ({type(bad).__name__}); pass a flat sequence "
            "of integers"
        )
    if out and (min(out) < 0 or max(out) > _MAX_ID):
        first = next(v for v in out if v < 0 or v > _MAX_ID)
        shown = f"{list(out[:16])}{'...' if len(out) > 16 else ''}"
        raise ValueError(f"{name} must be in [0, 2**63), got {first} (in {shown})")
    return out


def _is_bool(value: object) -> bool:
    """Whether ``value`` is a bool: Python's, numpy's, or a tensor or array of dtype bool
    (``operator.index`` takes a 0-d bool tensor as 0 or 1, which is never meant as an id)."""
    if isinstance(value, (bool, np.bool_)):
        return True
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return False
    # torch is not imported here (the scheduler process needs no torch): a value whose dtype is
    # torch.bool can only exist once torch is loaded, so sys.modules is where to look for it
    torch = sys.modules.get("torch")
    return (torch is not None and dtype is torch.bool) or dtype == np.bool_


def _is_index(value: object) -> bool:
    """Whether ``value`` is an integer that ``operator.index`` takes (a bool is not)."""
    if _is_bool(value):
        return False
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


@dataclass(frozen=True)
class GPUBlockSpec:
    """The GPU side of a job.

    Attributes:
        block_ids: GPU block ids of all KV cache groups, concatenated in group order.
        group_sizes: how many of ``block_ids`` belong to each group (one entry per group,
            0 allowed); ``sum(group_sizes) == len(block_ids)`` (docs/design.md invariant 1).
        block_indices: per group, the logical index (position in the request, in GPU blocks)
            of the group's first block; ``block_indices[g] % block_size_factor`` is the offset
            of that block inside its offloaded block (a partial first offloaded block).

    Raises:
        ValueError: when the sizes disagree, a value is negative, or a group's blocks would end
            past logical index 2**63 - 2 (``block_indices[g] + group_sizes[g]`` must fit int64).
        TypeError: a value that is not an int.
    """

    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", _int_tuple("block_ids", self.block_ids))
        object.__setattr__(self, "group_sizes", _int_tuple("group_sizes", self.group_sizes))
        object.__setattr__(self, "block_indices", _int_tuple("block_indices", self.block_indices))
        if sum(self.group_sizes) != len(self.block_ids):
            raise ValueError(
                f"sum(group_sizes)={sum(self.group_sizes)} != len(block_ids)="
                f"{len(self.block_ids)}: group_sizes must count every block id once, per group"
            )
        if len(self.block_indices) != len(self.group_sizes):
            raise ValueError(
                f"block_indices has {len(self.block_indices)} entries but group_sizes has "
                f"{len(self.group_sizes)}: give one entry per KV cache group"
            )
        for g, (start, n) in enumerate(zip(self.block_indices, self.group_sizes, strict=True)):
            if start + n > _MAX_ID:
                raise ValueError(
                    f"group {g}: block_indices[{g}]={start} with {n} blocks ends at logical "
                    f"index {start + n - 1}, past the largest one (2**63 - 2): logical indices "
                    "count GPU blocks from the request's start and travel as int64"
                )

    @classmethod
    def single_group(cls, block_ids: Sequence[int], block_index: int = 0) -> GPUBlockSpec:
        """A spec for a model with one KV cache group starting at logical ``block_index``.

        Raises:
            ValueError, TypeError: as the constructor (negative or non-int ids; a set, a dict
                or a str; bools).
        """
        ids = _int_tuple("block_ids", block_ids)
        return cls(ids, (len(ids),), (block_index,))


@dataclass(frozen=True)
class CPUBlockSpec:
    """The CPU side of a job: CPU block ids (slots), for all groups in group order.

    For group ``g`` with ``n`` GPU blocks starting at logical index ``s``, the job uses
    ``(s + n - 1) // block_size_factor - s // block_size_factor + 1`` CPU blocks (0 if n == 0).

    Raises:
        ValueError: a negative block id.
        TypeError: block ids that are not a sequence of ints.
    """

    block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", _int_tuple("block_ids", self.block_ids))


@dataclass(frozen=True)
class TransferResult:
    """What became of one job.

    Attributes:
        job_id: the id given to :meth:`OffloadingWorker.transfer_async`.
        direction: ``"store"`` (GPU→CPU) or ``"load"`` (CPU→GPU).
        success: False when the copy raised (nothing of a failed job may be used as a hit).
        num_bytes: bytes the job moved (0 when it failed).
        seconds: wall time of the copy (CPU), or GPU time between the job's events (CUDA).
        error: the error message when ``success`` is False.
        mechanism: how the bytes moved: ``"memcpy"``, ``"batch"``, ``"kernel"``,
            ``"per_block"`` or ``"staged"`` (``"batch"`` may have fallen back to copy calls
            where ``cudaMemcpyBatchAsync`` is unsupported; several groups that moved
            differently give the names joined by ``+``); ``"cpu"`` for CPU-only copies, and
            ``"staged"`` when staging was forced on the CPU.
    """

    job_id: int
    direction: Direction
    success: bool
    num_bytes: int
    seconds: float
    error: str | None = None
    mechanism: str = "cpu"


def _job_id(job_id: object, where: str = "job_id", unchanged: str = "nothing was submitted") -> int:
    """``job_id`` as an int (numpy integers accepted); ``unchanged`` ends the error message
    (what the caller left as it was).

    Raises:
        TypeError: ``job_id`` is not an integer (a bool, a float, a str or None).
    """
    if isinstance(job_id, bool) or not _is_index(job_id):
        raise TypeError(
            f"{where}: job_id must be an int, got {job_id!r} ({type(job_id).__name__}); {unchanged}"
        )
    return operator.index(job_id)  # type: ignore[arg-type]


def _job_ids(job_ids: object, unchanged: str) -> list[int]:
    """``job_ids`` (a list, tuple, set or 1-D integer array of job ids) as a list of ints, in
    its order; ``unchanged`` ends the error message.

    Raises:
        TypeError: ``job_ids`` is a single id, a str, bytes, a dict, None or anything else that
            is not a collection of ids, or one of its items is not an int.
    """
    # the engines' case, a list of ints, checked in 4 us for 200 ids (62 us one by one)
    ids: Any = job_ids
    if ids.__class__ in (list, tuple) and all(j.__class__ is int for j in ids):
        return list(ids)
    items = None
    if not isinstance(job_ids, (str, bytes, dict)):
        # not iterable (an int, None), or a 0-d tensor or array: items stays None
        with contextlib.suppress(TypeError):
            items = list(job_ids)  # type: ignore[call-overload]
    if items is None:
        raise TypeError(
            f"job_ids must be a list of job ids (ints), got {type(job_ids).__name__} "
            f"{job_ids!r}; wrap a single id in a list. {unchanged[:1].upper()}{unchanged[1:]}"
        )
    return [_job_id(j, f"job_ids[{k}]", unchanged) for k, j in enumerate(items)]


def _trusted(cls: type[_T], **fields: Any) -> _T:
    """A frozen dataclass instance (without ``__slots__``) from fields known to be valid: every
    field given, ``__init__`` and ``__post_init__`` skipped, the values put straight into the
    instance's ``__dict__`` (a few times cheaper than the frozen ``__init__``; for objects made
    per job on the engine's step path)."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def _sides(
    src: GPUBlockSpec | CPUBlockSpec, dst: GPUBlockSpec | CPUBlockSpec
) -> tuple[Direction, GPUBlockSpec, CPUBlockSpec]:
    """``(direction, gpu side, cpu side)`` of a job.

    Raises:
        ValueError: both sides of the same type (or neither a block spec).
    """
    if isinstance(src, GPUBlockSpec) and isinstance(dst, CPUBlockSpec):
        return "store", src, dst
    if isinstance(src, CPUBlockSpec) and isinstance(dst, GPUBlockSpec):
        return "load", dst, src
    raise ValueError(
        f"a job copies GPUBlockSpec→CPUBlockSpec (store) or CPUBlockSpec→GPUBlockSpec "
        f"(load), got {type(src).__name__}→{type(dst).__name__}"
    )
