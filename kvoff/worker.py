"""The worker: owns the CPU pool and moves blocks between it and the engine's GPU KV cache.

One worker runs per tensor-parallel rank. It registers the engine's KV cache tensors as block
rows, allocates the CPU pool (pinned when CUDA is available), and runs load (CPU→GPU) and store
(GPU→CPU) jobs through ``torch.ops.kvoff.copy_blocks``.

**GPU rows** (docs/design.md "Moving bytes"): each registered tensor is viewed as
``(num_gpu_blocks, row_bytes)`` uint8 rows, using the engine's ``num_gpu_blocks`` (never the
tensor's leading dimension: docs/design.md invariant 2). Views over the same bytes (a tensor shared
by layers of several groups) form one *canonical* tensor.

**The CPU pool is slot-major.** One CPU block (slot) is one contiguous region of
``slot_bytes = block_size_factor × bytes_per_gpu_block``: ``block_size_factor`` sub-blocks, each
holding one GPU block of every canonical tensor, in registration order. GPU block ``i`` of
offloaded block ``j`` lands in sub-block ``cpu_block_id × block_size_factor + i %
block_size_factor``. So one GPU block of all layers is one contiguous chunk on the CPU side, and
one offloaded block is one contiguous object (:meth:`OffloadingWorker.cpu_slot`), the unit a
disk or a shared store keeps.

**GPU layouts.** Per KV cache group, adjacent copy regions are merged when they are adjacent on
both sides (same GPU storage and block stride, consecutive bytes in a block and in a sub-block):

* ``block_contiguous``: one region per block (all layers of a block in one contiguous region:
  vLLM's cross-layer layout, TRT-LLM's; or a single-tensor model). Whole blocks move by copy
  engines: one chunk per run of adjacent blocks.
* ``layer_major``: several regions per block (one tensor per layer, the common case). Jobs move
  either directly (copy calls, one batched call, or the SM kernel over the small chunks) or
  ``staged`` (:mod:`kvoff.staging`: an SM gather into a GPU staging buffer laid out like the
  slot, then copy-engine DMA of whole sub-blocks; loads in reverse).

``mechanism="auto"`` picks, per job and group, the fastest way whose slowdown of concurrent
compute stays within ``compute_slowdown_budget`` (:func:`kvoff.transfer.choose_mechanism`).

On CPU builds jobs run synchronously inside :meth:`OffloadingWorker.transfer_async` (a parallel
memcpy; ``"staged"`` can be forced and runs the same staging logic with a CPU buffer). On CUDA
each direction has its own copy stream and its own SM stream (FIFO within a direction), every job
records events, and :meth:`OffloadingWorker.get_finished` polls them without blocking.
:meth:`OffloadingWorker.transfer_many_async` submits one step's jobs of a direction together:
one copy per group and one pair of events for all of them, one result per job.

The CPU pool is one exact-size host allocation (no power-of-two rounding), page-locked by one call
when pinned (:class:`kvoff.pinned.HostPool`).
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
import torch

from kvoff.ops import batch_copy_supported, copy_blocks_fast
from kvoff.pinned import HostPool
from kvoff.registration import KVLayout, block_row_views
from kvoff.staging import (
    DEFAULT_STAGING_BYTES,
    DEFAULT_STAGING_PIECE_BYTES,
    Lane,
    StagedGroup,
    StagingRing,
    staged_load,
    staged_store,
)
from kvoff.transfer import (
    ALL_MECHANISMS,
    DEFAULT_COMPUTE_SLOWDOWN_BUDGET,
    TransferThresholds,
    choose_mechanism,
    default_thresholds,
)

if TYPE_CHECKING:
    from kvoff.config import OffloadingConfig
    from kvoff.offloading_spec import CPUOffloadingSpec
    from kvoff.specs import KVCacheConfig

__all__ = ["GPU_LAYOUTS", "CPUBlockSpec", "GPUBlockSpec", "OffloadingWorker", "TransferResult"]

Direction = Literal["store", "load"]

GPU_LAYOUTS: tuple[str, ...] = ("block_contiguous", "layer_major")
"""The GPU layouts a KV cache group can have (see the module docstring)."""


_MAX_ID = 2**63 - 1
"""The largest id or count a job may hold: ids travel as int64 (numpy, the copy ops, the core)."""


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
        bad = next((v for v in items if v.__class__ is not int and _is_bool(v)), None)
    except TypeError:
        bad = next((v for v in items if not _is_index(v)), values)
    if bad is not None:
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
    return dtype is not None and (dtype is torch.bool or dtype == np.bool_)


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


_EMPTY_IDS = np.empty(0, dtype=np.int64)


class _CPUBlockOutOfRange(ValueError):
    """A job's CPU block id is not in ``[0, num_cpu_blocks)``: the job fails (a failed
    :class:`TransferResult`), as for any out-of-range id, and nothing of it is copied."""


def _cpu_range_error(cpu_ids: np.ndarray, num_cpu_blocks: int) -> _CPUBlockOutOfRange | None:
    """The error for the first CPU block id of ``cpu_ids`` at or above ``num_cpu_blocks``, or
    None when every id is in range (ids are already known to be >= 0)."""
    if len(cpu_ids) == 0 or cpu_ids.max() < num_cpu_blocks:
        return None
    first = int(cpu_ids[cpu_ids >= num_cpu_blocks][0])
    return _CPUBlockOutOfRange(
        f"CPU block id {first} is out of range; CPU block ids must be in [0, {num_cpu_blocks}). "
        "The job was not run."
    )


@dataclass
class _Region:
    """One copied byte region of a block: GPU rows and their place in the slot."""

    gpu_rows: torch.Tensor  # (num_gpu_blocks, row_bytes) uint8 view of the GPU cache
    cpu_offset: int  # byte offset inside a sub-block
    row_bytes: int
    cpu_rows: torch.Tensor | None = None  # (num_cpu_blocks × f, row_bytes) view of the pool


@dataclass
class _Group:
    views: list[_Region] = field(default_factory=list)  # one per registered row view
    regions: list[_Region] = field(default_factory=list)  # views merged where adjacent
    row_bytes: int = 0  # bytes per GPU block of this group (sum of its views' rows)
    cpu_runs: list[tuple[int, int]] = field(default_factory=list)  # used slot byte ranges
    cpu_run_rows: list[torch.Tensor] = field(default_factory=list)
    gpu_side: list[torch.Tensor] = field(default_factory=list)  # regions' GPU rows
    cpu_side: list[torch.Tensor] = field(default_factory=list)  # regions' CPU rows

    @property
    def layout(self) -> str:
        return "block_contiguous" if len(self.regions) == 1 else "layer_major"

    staged: StagedGroup | None = None  # what a staged copy of this group needs (made once)


_T = TypeVar("_T")


def _job_id(job_id: object, where: str = "job_id") -> int:
    """``job_id`` as an int (numpy integers accepted).

    Raises:
        TypeError: ``job_id`` is not an integer (a bool, a float, a str or None).
    """
    if isinstance(job_id, bool) or not _is_index(job_id):
        raise TypeError(
            f"{where}: job_id must be an int, got {job_id!r} ({type(job_id).__name__}); "
            "nothing was submitted"
        )
    return operator.index(job_id)  # type: ignore[arg-type]


def _trusted(cls: type[_T], **fields: Any) -> _T:
    """A frozen dataclass instance (without ``__slots__``) from fields known to be valid: every
    field given, ``__init__`` and ``__post_init__`` skipped, the values put straight into the
    instance's ``__dict__`` (a few times cheaper than the frozen ``__init__``; for objects made
    per job on the engine's step path)."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def _shares(byte_counts: Sequence[int]) -> list[float]:
    """Each job's share of a submission's time, by its bytes (equal shares when none moved)."""
    total = sum(byte_counts)
    return [nb / total if total else 1 / len(byte_counts) for nb in byte_counts]


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


@dataclass
class _InFlight:
    job_id: int
    direction: Direction
    num_bytes: int
    mechanism: str
    start: torch.cuda.Event
    end: torch.cuda.Event
    share: float = 1.0  # this job's part of its submission's bytes (transfer_many_async)


def _adjacent(a: _Region, b: _Region) -> bool:
    """Whether region ``b`` continues region ``a`` in both the GPU cache and the slot."""
    ga, gb = a.gpu_rows, b.gpu_rows
    return (
        ga.untyped_storage().data_ptr() == gb.untyped_storage().data_ptr()
        and ga.stride(0) == gb.stride(0)
        and gb.storage_offset() == ga.storage_offset() + a.row_bytes
        and (ga.shape[0] == 1 or a.row_bytes + b.row_bytes <= ga.stride(0))
        and b.cpu_offset == a.cpu_offset + a.row_bytes
    )


def _merge(a: _Region, b: _Region) -> _Region:
    rows = a.gpu_rows.as_strided(
        (a.gpu_rows.shape[0], a.row_bytes + b.row_bytes),
        (a.gpu_rows.stride(0), 1),
        a.gpu_rows.storage_offset(),
    )
    return _Region(rows, a.cpu_offset, a.row_bytes + b.row_bytes)


def _num_runs(*ids: np.ndarray) -> int:
    """Runs of positions where every id list goes up by one (1 for one id, 0 for none)."""
    n = len(ids[0])
    if n == 0:
        return 0
    breaks = np.zeros(n - 1, dtype=bool)
    for t in ids:
        breaks |= np.diff(t) != 1
    return int(breaks.sum()) + 1


class OffloadingWorker:
    """Moves KV blocks between the registered GPU KV cache and its CPU pool.

    Args:
        num_gpu_blocks: GPU blocks of the engine's cache (``KVCacheConfig.num_blocks``). It is
            authoritative: tensors are viewed with this many rows, whatever their shape.
        num_cpu_blocks: CPU slots (offloaded blocks) to allocate.
        block_size_factor: GPU blocks per offloaded block.
        kv_cache_config: the engine's GPU cache plan; when given, layers are grouped and checked
            against its specs at registration (see :meth:`from_spec`).
        pin_memory: pin the CPU pool (default: when CUDA is available).
        mechanism: how jobs copy: ``"auto"`` (per job and group: the fastest mechanism whose
            compute slowdown is within ``compute_slowdown_budget``) or one of ``"memcpy"``,
            ``"batch"``, ``"kernel"``, ``"per_block"``, ``"staged"`` for every job
            (``kvoff.transfer.ALL_MECHANISMS``). On the CPU, ``"staged"`` runs the staging
            logic with a CPU buffer and every other name the parallel memcpy.
        thresholds: what ``"auto"`` decides from (default: :func:`kvoff.transfer.load_thresholds`:
            ``$KVOFF_TRANSFER_THRESHOLDS`` or the packaged H100 measurement).
        compute_slowdown_budget: the largest slowdown of concurrent compute ``"auto"`` accepts,
            as a fraction (default 0.03: 3 %).
        staging_bytes: bytes of GPU staging buffer for ``"staged"`` jobs, both directions
            together (half each; default 64 MiB); at least two GPU blocks of all layers when
            staging is used; 0 disables staging. Allocated at registration on CUDA when some
            group is layer-major, on first use otherwise.
        staging_piece_bytes: bytes of one piece of a staged job (rounded down to whole GPU
            blocks of all layers, at least one; default 8 MiB).
        shared_memory_name: allocate the CPU pool in ``/dev/shm/<name>``
            (:class:`kvoff.pinned.HostPool`'s ``shared_name``) so that another process maps it
            (:class:`kvoff.pinned.SharedHostPool`): the engine-core process, whose scheduler
            drives the secondary tiers, when this worker runs in a process of its own. Default
            ``None``: private memory.

    Raises:
        ValueError: on non-positive sizes, a negative budget or staging size, or an unknown
            mechanism.
        TypeError: a size that is not an int (or a bool), a budget that is not a number.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size_factor: int = 1,
        *,
        kv_cache_config: KVCacheConfig | None = None,
        pin_memory: bool | None = None,
        mechanism: str = "auto",
        thresholds: TransferThresholds | None = None,
        compute_slowdown_budget: float = DEFAULT_COMPUTE_SLOWDOWN_BUDGET,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        staging_piece_bytes: int = DEFAULT_STAGING_PIECE_BYTES,
        shared_memory_name: str | None = None,
    ) -> None:
        if mechanism not in ALL_MECHANISMS:
            raise ValueError(
                f"mechanism={mechanism!r} is not one of {list(ALL_MECHANISMS)}; use 'auto' to "
                "let each job choose"
            )
        for name, value in (
            ("num_gpu_blocks", num_gpu_blocks),
            ("num_cpu_blocks", num_cpu_blocks),
            ("block_size_factor", block_size_factor),
            ("staging_bytes", staging_bytes),
            ("staging_piece_bytes", staging_piece_bytes),
        ):
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        if isinstance(compute_slowdown_budget, bool) or not isinstance(
            compute_slowdown_budget, (int, float)
        ):
            raise TypeError(
                f"compute_slowdown_budget must be a number, got {compute_slowdown_budget!r}"
            )
        if not compute_slowdown_budget >= 0:
            raise ValueError(
                f"compute_slowdown_budget={compute_slowdown_budget} must be >= 0 (a fraction: "
                "0.03 accepts a 3 % slowdown of concurrent compute)"
            )
        if staging_bytes < 0 or staging_piece_bytes < 1:
            raise ValueError(
                f"staging_bytes ({staging_bytes}) must be >= 0 (0 disables staging) and "
                f"staging_piece_bytes ({staging_piece_bytes}) >= 1"
            )
        for name, value in (
            ("num_gpu_blocks", num_gpu_blocks),
            ("num_cpu_blocks", num_cpu_blocks),
            ("block_size_factor", block_size_factor),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        # numpy integers become ints: sizes multiply into byte counts that must not wrap
        self.num_gpu_blocks = operator.index(num_gpu_blocks)
        self.num_cpu_blocks = operator.index(num_cpu_blocks)
        self.block_size_factor = operator.index(block_size_factor)
        if kv_cache_config is not None and kv_cache_config.num_blocks != num_gpu_blocks:
            raise ValueError(
                f"num_gpu_blocks={num_gpu_blocks} differs from kv_cache_config.num_blocks="
                f"{kv_cache_config.num_blocks}; the config's count is authoritative"
            )
        self.kv_cache_config = kv_cache_config
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.mechanism = mechanism
        self.thresholds = thresholds
        self.compute_slowdown_budget = float(compute_slowdown_budget)
        self.staging_bytes = operator.index(staging_bytes)
        self.staging_piece_bytes = operator.index(staging_piece_bytes)
        self.shared_memory_name = shared_memory_name
        self._pool: HostPool | None = None
        self._pool_tensor: torch.Tensor | None = None
        self._batch_supported: bool | None = None
        self._groups: list[_Group] = []
        # pairs of groups with a canonical tensor in common (hybrid models): a destination id
        # in both writes the same bytes
        self._shared_pairs: list[tuple[int, int]] = []
        self._layer_names: list[str] = []
        self._canonical_row_bytes: list[int] = []
        self._device: torch.device | None = None
        self._finished: list[TransferResult] = []
        self._in_flight: dict[int, _InFlight] = {}
        self._dma: dict[Direction, Lane] = {}
        self._sm: dict[Direction, Lane] = {}
        self._rings: dict[Direction, StagingRing] = {}
        self._closed = False

    @classmethod
    def from_spec(
        cls,
        spec: CPUOffloadingSpec,
        *,
        pin_memory: bool | None = None,
        config: OffloadingConfig | None = None,
        shared_memory_name: str | None = None,
    ) -> OffloadingWorker:
        """A worker for one rank of the plan ``spec`` (a :class:`kvoff.CPUOffloadingSpec`): GPU
        blocks from its ``KVCacheConfig.num_blocks``, CPU slots and block_size_factor from the
        same spec the scheduler uses, so every rank's pool matches the scheduler's count.
        ``config`` (an :class:`kvoff.OffloadingConfig`) supplies the pinning and transfer options
        (:meth:`~kvoff.OffloadingConfig.worker_options`); an explicit ``pin_memory`` wins.
        ``shared_memory_name`` is passed on (see the class).

        Raises:
            ValueError: when the config's thresholds file cannot be read.
        """
        options = {} if config is None else config.worker_options()
        if pin_memory is not None or config is None:
            options["pin_memory"] = pin_memory
        return cls(
            spec.kv_cache_config.num_blocks,
            spec.num_blocks,
            spec.block_size_factor,
            kv_cache_config=spec.kv_cache_config,
            shared_memory_name=shared_memory_name,
            **options,
        )

    # ------------------------------------------------------------------ registration
    def _layer_plan(
        self, kv_caches: Mapping[str, object], layer_to_group: Mapping[str, int] | None
    ) -> tuple[dict[str, int], dict[str, object | None]]:
        """Layer → group and layer → spec, from the KVCacheConfig when there is one."""
        config = self.kv_cache_config
        if config is None:
            mapping = dict(layer_to_group or dict.fromkeys(kv_caches, 0))
            return mapping, dict.fromkeys(mapping)
        mapping: dict[str, int] = {}
        specs: dict[str, object | None] = {}
        for g, group in enumerate(config.kv_cache_groups):
            group_spec = group.kv_cache_spec
            per_layer = getattr(group_spec, "kv_cache_specs", None)
            for name in group.layer_names:
                mapping[name] = g
                specs[name] = dict(per_layer)[name] if per_layer is not None else group_spec
        if layer_to_group is not None and dict(layer_to_group) != mapping:
            raise ValueError(
                "layer_to_group disagrees with the KVCacheConfig's groups; leave it out when "
                "the worker has a kv_cache_config"
            )
        return mapping, specs

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
        layer_to_group: Mapping[str, int] | None = None,
        *,
        kv_layout: KVLayout = "auto",
    ) -> None:
        """Register the engine's KV cache tensors and allocate the CPU pool (and, on CUDA with a
        layer-major group, the staging buffer).

        Each layer's tensor becomes one or more ``(num_gpu_blocks, row_bytes)`` block-row views
        (see :func:`kvoff.registration.block_row_views` for the layouts: blocks first, K/V
        first, kernel blocks, tensors shared across groups, padded Mamba pages), always using
        ``num_gpu_blocks`` (``KVCacheConfig.num_blocks``), never the tensor's leading dimension
        (docs/design.md invariant 2). The CPU pool is ``num_cpu_blocks`` slots of
        :attr:`slot_bytes` (see the module docstring). Views that are adjacent in the GPU block
        and in the slot are copied as one region; a group with one region per block is
        ``block_contiguous`` (:attr:`gpu_layouts`).

        Args:
            kv_caches: layer name → that layer's KV cache tensor (any dtype; bytes are copied as
                they are), or for a Mamba layer a list of its state tensors. Layers of a
                block-contiguous cache are views into one buffer, registered in the order of
                their bytes inside a block.
            layer_to_group: layer name → KV cache group index (default: from the worker's
                ``kv_cache_config``, else all layers in group 0). Groups are numbered 0..G-1.
            kv_layout: ``"auto"``, ``"blocks_first"`` or ``"kv_first"`` for attention tensors.

        Raises:
            ValueError: when already registered, when ``kv_caches`` is empty or does not name
                exactly the config's layers, when tensors are on different devices or on the
                meta device, when a tensor's bytes do not fit ``num_gpu_blocks`` blocks of its
                spec's page, when groups have gaps, or when ``staging_bytes`` is too small for
                one GPU block of all layers in each direction (nothing is registered then).
        """
        if self._groups:
            raise ValueError("register_kv_caches was already called on this worker")
        if not kv_caches:
            raise ValueError("kv_caches is empty: register at least one layer")
        devices = {
            t.device
            for v in kv_caches.values()
            for t in ([v] if isinstance(v, torch.Tensor) else v)
        }
        if len(devices) != 1:
            raise ValueError(
                f"all KV cache tensors must be on one device, got {sorted(map(str, devices))}"
            )
        if next(iter(devices)).type == "meta":  # no storage: a store would copy nothing
            raise ValueError(
                "the KV cache tensors are on the meta device (shapes only, no memory); "
                "register the engine's allocated tensors (cuda or cpu)"
            )
        mapping, specs = self._layer_plan(kv_caches, layer_to_group)
        if set(mapping) != set(kv_caches):
            raise ValueError(
                "the registered layers must be exactly the planned ones; missing "
                f"{sorted(set(mapping) - set(kv_caches))}, "
                f"unknown {sorted(set(kv_caches) - set(mapping))}"
            )
        num_groups = max(mapping.values()) + 1
        if sorted(set(mapping.values())) != list(range(num_groups)):
            raise ValueError(
                f"KV cache group indices must be 0..{num_groups - 1} without gaps, got "
                f"{sorted(set(mapping.values()))}"
            )
        # Block rows over the same bytes (one tensor shared by layers of several groups, or
        # by several layers of one group) form ONE canonical tensor with ONE place in the slot:
        # a slot holds one offloaded block of one group, so a slot's bytes are the bytes one GPU
        # block id costs in the shared pool (invariant 3), not page × number of layers.
        canon: dict[tuple[int, int], int] = {}  # (address of row 0, row stride) -> index
        canon_rows: list[int] = []  # widest row any layer copies from that canonical tensor
        per_group: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(num_groups)]
        seen: set[tuple[int, int, int]] = set()  # (group, canonical, row bytes)
        for name, kv in kv_caches.items():
            g = mapping[name]
            for rows in block_row_views(name, kv, self.num_gpu_blocks, specs[name], kv_layout):
                key = (rows.data_ptr(), rows.stride(0))
                c = canon.setdefault(key, len(canon))
                if c == len(canon_rows):
                    canon_rows.append(0)
                canon_rows[c] = max(canon_rows[c], rows.shape[1])
                if (g, c, rows.shape[1]) not in seen:
                    seen.add((g, c, rows.shape[1]))
                    per_group[g].append((c, rows))
        offsets = [sum(canon_rows[:c]) for c in range(len(canon_rows))]
        sub_block = sum(canon_rows)
        groups = [_Group() for _ in range(num_groups)]
        for g, views in enumerate(per_group):
            group = groups[g]
            for c, rows in views:
                region = _Region(rows, offsets[c], rows.shape[1])
                group.views.append(region)
                group.row_bytes += region.row_bytes
                if group.regions and _adjacent(group.regions[-1], region):
                    group.regions[-1] = _merge(group.regions[-1], region)
                else:
                    group.regions.append(_Region(rows, offsets[c], rows.shape[1]))
            spans = sorted((r.cpu_offset, r.row_bytes) for r in group.views)
            for off, length in spans:
                if group.cpu_runs and group.cpu_runs[-1][0] + group.cpu_runs[-1][1] >= off:
                    last_off, last_len = group.cpu_runs[-1]
                    group.cpu_runs[-1] = (last_off, max(last_len, off + length - last_off))
                else:
                    group.cpu_runs.append((off, length))
        device = next(iter(devices))
        layer_major = any(g.layout == "layer_major" for g in groups)
        if device.type == "cuda" and layer_major and self.staging_bytes:
            self._check_staging_size(sub_block)

        f = self.block_size_factor
        pool = HostPool(
            [(self.num_cpu_blocks, sub_block * f)],
            pin=self.pin_memory,
            shared_name=self.shared_memory_name,
            description=(
                f"the CPU pool ({self.num_cpu_blocks} CPU blocks of {sub_block * f} bytes: "
                f"{f} x {sub_block} bytes per GPU block over {len(canon_rows)} tensors)"
            ),
        )
        (pool_tensor,) = pool.tensors
        rows_total = self.num_cpu_blocks * f

        def pool_rows(offset: int, length: int) -> torch.Tensor:
            return pool_tensor.as_strided(
                (rows_total, length), (sub_block, 1), pool_tensor.storage_offset() + offset
            )

        for group in groups:
            for r in (*group.views, *group.regions):
                r.cpu_rows = pool_rows(r.cpu_offset, r.row_bytes)
            group.cpu_run_rows = [pool_rows(o, n) for o, n in group.cpu_runs]
            group.gpu_side = [r.gpu_rows for r in group.regions]
            group.cpu_side = [r.cpu_rows for r in group.regions]  # type: ignore[misc]
            group.staged = StagedGroup(
                group.gpu_side, [r.cpu_offset for r in group.regions], group.cpu_runs,
                group.cpu_run_rows,
            )  # fmt: skip
        self._pool = pool
        self._pool_tensor = pool_tensor
        self._canonical_row_bytes = canon_rows
        self._groups = groups
        canons = [{c for c, _ in views} for views in per_group]
        self._shared_pairs = [
            (g, h)
            for g in range(num_groups)
            for h in range(g + 1, num_groups)
            if canons[g] & canons[h]
        ]
        self._layer_names = list(kv_caches)
        self._device = device
        self._dma = {"store": Lane(device), "load": Lane(device)}
        self._sm = {"store": Lane(device), "load": Lane(device)}
        if device.type == "cuda" and layer_major and self.staging_bytes:
            for direction in ("store", "load"):
                self._ring(direction)

    def _check_staging_size(self, sub_block: int) -> None:
        if self.staging_bytes // 2 < sub_block:
            raise ValueError(
                f"staging_bytes={self.staging_bytes} gives {self.staging_bytes // 2} bytes per "
                f"direction, less than one GPU block of all layers ({sub_block} bytes); raise "
                f"staging_bytes to at least {2 * sub_block}, or set it to 0 to disable staging"
            )

    def _ring(self, direction: Direction) -> StagingRing:
        ring = self._rings.get(direction)
        if ring is None:
            assert self._device is not None
            if not self.staging_bytes:
                raise ValueError(
                    "mechanism 'staged' needs a staging buffer, but staging_bytes=0; give the "
                    f"worker staging_bytes >= {2 * self.bytes_per_gpu_block} (two GPU blocks of "
                    "all layers) or choose another mechanism"
                )
            self._check_staging_size(self.bytes_per_gpu_block)
            ring = StagingRing(
                self._device,
                self.staging_bytes // 2,
                self.bytes_per_gpu_block,
                self.staging_piece_bytes,
            )
            self._rings[direction] = ring
        return ring

    # ------------------------------------------------------------------ properties
    @property
    def num_groups(self) -> int:
        """KV cache groups registered."""
        return len(self._groups)

    @property
    def gpu_layouts(self) -> list[str]:
        """Per KV cache group, ``"block_contiguous"`` (all of a block's bytes one region) or
        ``"layer_major"`` (:data:`GPU_LAYOUTS`)."""
        return [g.layout for g in self._groups]

    @property
    def bytes_per_gpu_block(self) -> int:
        """Bytes one GPU block id costs over the registered tensors of this rank (each
        canonical tensor counted once, however many layers or groups share it; Mamba padding
        not counted): the size of a sub-block of a slot. Equals
        ``CPUOffloadingSpec.kv_bytes_per_block`` without padding."""
        return sum(self._canonical_row_bytes)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one CPU block (slot): ``block_size_factor × bytes_per_gpu_block``."""
        return self.bytes_per_gpu_block * self.block_size_factor

    @property
    def cpu_pool_bytes(self) -> int:
        """Bytes of block data in the CPU pool of this rank: ``slot_bytes × num_cpu_blocks``."""
        return self.slot_bytes * self.num_cpu_blocks

    @property
    def cpu_pool_allocated_bytes(self) -> int:
        """Bytes actually allocated (and pinned, when pinned) for the CPU pool: exactly
        :attr:`cpu_pool_bytes`; 0 before registration."""
        return 0 if self._pool is None else self._pool.num_bytes

    @property
    def cpu_pool_pinned(self) -> bool:
        """Whether the CPU pool is page-locked."""
        return self._pool is not None and self._pool.pinned

    @property
    def staging_allocated_bytes(self) -> int:
        """Bytes of staging buffer allocated so far (both directions; on the GPU side's
        device)."""
        return sum(r.num_bytes for r in self._rings.values())

    @property
    def cpu_pool(self) -> torch.Tensor:
        """The CPU pool as a ``(num_cpu_blocks, slot_bytes)`` uint8 tensor (row ``i`` is CPU
        block ``i``).

        Raises:
            ValueError: before :meth:`register_kv_caches`.
        """
        if self._pool_tensor is None:
            raise ValueError("no KV caches registered: call register_kv_caches first")
        return self._pool_tensor

    def cpu_slot(self, cpu_block_id: int) -> torch.Tensor:
        """The bytes of CPU block ``cpu_block_id``: a contiguous ``(slot_bytes,)`` uint8 view
        (sub-block ``k`` at ``k × bytes_per_gpu_block``; in it, the canonical tensors in
        registration order).

        Raises:
            ValueError: before registration.
            IndexError: for an id outside ``[0, num_cpu_blocks)``.
            TypeError: for an id that is not an int (a bool is not).
        """
        if isinstance(cpu_block_id, bool) or not _is_index(cpu_block_id):
            raise TypeError(
                f"cpu_block_id must be an int, got {cpu_block_id!r} ({type(cpu_block_id).__name__})"
            )
        cpu_block_id = operator.index(cpu_block_id)
        pool = self.cpu_pool
        if not 0 <= cpu_block_id < self.num_cpu_blocks:
            raise IndexError(
                f"cpu_block_id {cpu_block_id} is out of range; CPU block ids are in "
                f"[0, {self.num_cpu_blocks})"
            )
        return pool[cpu_block_id]

    def close(self) -> None:
        """Release the pinned registration of the CPU pool (after waiting for jobs in flight)
        and the staging buffers. Idempotent. The results of the jobs it waited for stay
        queued for :meth:`get_finished`; new jobs are refused afterwards."""
        if self._in_flight:
            results = self.wait(list(self._in_flight))
            self._finished.extend(results)  # still reported, as if they had finished alone
        if self._pool is not None:
            self._pool.close()
        self._rings.clear()
        self._closed = True

    def _check_open(self) -> None:
        """Raises:
        RuntimeError: after :meth:`close` (its pool is released: a job would copy into freed
            memory)."""
        if self._closed:
            raise RuntimeError(
                "the worker was closed (close() released its CPU pool); build a new "
                "OffloadingWorker to run jobs"
            )

    def cpu_tensors(self) -> list[torch.Tensor]:
        """The CPU pool as ``(num_cpu_blocks × block_size_factor, row_bytes)`` uint8 row views
        (row stride: one sub-block), one per block-row view of :meth:`gpu_tensors`, in the same
        order."""
        return [v.cpu_rows for g in self._groups for v in g.views]  # type: ignore[misc]

    def gpu_tensors(self) -> list[torch.Tensor]:
        """The registered KV caches as ``(num_gpu_blocks, row_bytes)`` uint8 block-row views, in
        group order (a tensor shared by several groups appears once per group)."""
        return [v.gpu_rows for g in self._groups for v in g.views]

    # ------------------------------------------------------------------ jobs
    def _expand(self, gpu: GPUBlockSpec, cpu: CPUBlockSpec) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per group: (GPU block ids, CPU sub-block rows) as int64 arrays."""
        if len(gpu.group_sizes) != len(self._groups):
            raise ValueError(
                f"the job has {len(gpu.group_sizes)} group_sizes entries but "
                f"{len(self._groups)} KV cache groups are registered; give one per group"
            )
        f = self.block_size_factor
        out: list[tuple[np.ndarray, np.ndarray]] = []
        gpu_ids = np.asarray(gpu.block_ids, dtype=np.int64)
        cpu_ids = np.asarray(cpu.block_ids, dtype=np.int64)
        # Rows are id × f + offset: an id past the pool is clamped first so that the product
        # cannot wrap around int64 into a valid row; the job then fails below, naming the id.
        safe = cpu_ids if f == 1 else np.minimum(cpu_ids, self.num_cpu_blocks)
        gpu_off = 0
        cpu_off = 0
        for n, start in zip(gpu.group_sizes, gpu.block_indices, strict=True):
            if n == 0:
                out.append((_EMPTY_IDS, _EMPTY_IDS))
                continue
            first = start // f
            count = (start + n - 1) // f - first + 1
            if cpu_off + count > len(cpu_ids):
                raise ValueError(
                    f"the CPU side has {len(cpu_ids)} block ids, but the GPU side needs at least "
                    f"{cpu_off + count} (group sizes {list(gpu.group_sizes)}, block indices "
                    f"{list(gpu.block_indices)}, block_size_factor {f})"
                )
            if f == 1:
                rows = cpu_ids[cpu_off : cpu_off + n]
            else:
                logical = np.arange(start, start + n, dtype=np.int64)
                rows = safe[cpu_off + logical // f - first] * f + logical % f
            out.append((gpu_ids[gpu_off : gpu_off + n], rows))
            gpu_off += n
            cpu_off += count
        if cpu_off != len(cpu_ids):
            raise ValueError(
                f"the CPU side has {len(cpu_ids)} block ids but the GPU side covers {cpu_off} "
                f"offloaded blocks (group sizes {list(gpu.group_sizes)}, block indices "
                f"{list(gpu.block_indices)}, block_size_factor {f})"
            )
        if f > 1 and (error := _cpu_range_error(cpu_ids, self.num_cpu_blocks)) is not None:
            raise error
        return out

    def transfer_async(
        self, job_id: int, src: GPUBlockSpec | CPUBlockSpec, dst: GPUBlockSpec | CPUBlockSpec
    ) -> bool:
        """Submit one job: a store (``GPUBlockSpec`` → ``CPUBlockSpec``) or a load (the reverse).

        On CPU the copy runs before this returns; its result is queued for
        :meth:`get_finished`. On CUDA the copies are queued on the direction's streams, and
        both directions first wait for the work already queued on the current (compute)
        stream: a store must see the forward pass's writes to its GPU blocks, and a load must
        land after every earlier write to (or read of) its destination blocks, such as the
        last forward pass into a block since freed and handed to this request, or zeroing of
        a fresh block. vLLM's own CPU offloading worker orders its loads the same way. Work
        queued on the compute stream after this call is not ordered against the job: the
        engine waits for the job (:meth:`get_finished` / :meth:`wait`) before it reads loaded
        blocks or overwrites stored ones.

        Returns:
            True when the job was submitted (CUDA) or ran successfully (CPU); False when the
            copy failed (for example an out-of-range block id): the failure is also reported as
            ``TransferResult(success=False)``, nothing of the job was copied and no other job's
            blocks are touched.

        Raises:
            ValueError: when nothing is registered, ``job_id`` is still pending (in flight, or
                its result not taken by :meth:`get_finished` or :meth:`wait` yet), both sides
                have the same type, or the two sides do not describe the same blocks.
            TypeError: ``job_id`` is not an int.
            RuntimeError: after :meth:`close`.
        """
        if not self._groups:
            raise ValueError("no KV caches registered: call register_kv_caches first")
        job_id = _job_id(job_id)
        if job_id in self._in_flight or any(r.job_id == job_id for r in self._finished):
            raise ValueError(
                f"job_id {job_id} is still pending (in flight, or its result not taken yet by "
                "get_finished or wait); use a fresh job id"
            )
        self._check_open()
        direction, gpu, cpu = _sides(src, dst)
        t0 = time.perf_counter()
        try:
            per_group = self._expand(gpu, cpu)
        except _CPUBlockOutOfRange as exc:
            self._finished.append(
                TransferResult(job_id, direction, False, 0, time.perf_counter() - t0, str(exc))
            )
            return False
        num_bytes = self._job_bytes(per_group)
        cuda = self._device is not None and self._device.type == "cuda"
        try:
            # Every group's ids are checked, and every mechanism resolved (which may allocate
            # the staging buffer), before the first copy, so a bad job copies nothing.
            self._check_ids(direction, per_group)
            mechanisms = [
                self._resolve_mechanism(direction, g, ids) if len(ids[0]) else ""
                for g, ids in zip(self._groups, per_group, strict=True)
            ]
        except (RuntimeError, ValueError, IndexError) as exc:
            self._finished.append(
                TransferResult(job_id, direction, False, 0, time.perf_counter() - t0, str(exc))
            )
            return False
        used = "+".join(sorted({m for m in mechanisms if m}))
        if not cuda:
            try:
                self._run(direction, per_group, mechanisms)
            except (RuntimeError, ValueError, IndexError) as exc:  # pragma: no cover - checked
                self._finished.append(
                    TransferResult(job_id, direction, False, 0, time.perf_counter() - t0, str(exc))
                )
                return False
            label = "staged" if "staged" in mechanisms else "cpu"
            self._finished.append(
                TransferResult(job_id, direction, True, num_bytes, time.perf_counter() - t0,
                               None, label)
            )  # fmt: skip
            return True
        return self._submit_cuda([(job_id, num_bytes)], direction, per_group, mechanisms, used)

    def transfer_many_async(
        self,
        jobs: Sequence[tuple[int, GPUBlockSpec | CPUBlockSpec, GPUBlockSpec | CPUBlockSpec]],
    ) -> list[bool]:
        """Submit several jobs of one direction together: one step's stores, or its loads.

        The result is what :meth:`transfer_async` of each ``(job_id, src, dst)`` in turn
        gives (each job still gets its own :class:`TransferResult`), but their blocks move as
        one copy per KV cache group: one call of the copy op (CPU), or one set of copies and
        one pair of CUDA events on the direction's streams (CUDA), instead of one per job. A
        step that stores one block for each of 16 requests pays the per-job cost (spec
        checks, id expansion, the copy op's launch and thread hand-off) once instead of 16
        times. ``mechanism="auto"`` decides on the jobs' blocks together.

        On CUDA every job of the call finishes when the last copy of the call ends, and its
        ``seconds`` is its share (by bytes) of the call's GPU time; on CPU its share of the
        call's wall time. The shares add up to the call's time, so bytes / seconds summed
        over jobs stays the real rate.

        A job whose ids are out of range (or whose destination ids repeat) fails alone, as
        in :meth:`transfer_async`: ``TransferResult(success=False)``, nothing of it copied.
        When two jobs of the call write the same destination block, the jobs are submitted
        one by one instead (in order, so the later write wins, as in separate calls).

        Args:
            jobs: ``(job_id, src, dst)`` triples, as :meth:`transfer_async` takes them; all
                stores (``GPUBlockSpec`` → ``CPUBlockSpec``) or all loads.

        Returns:
            Per job, in order: True when it was submitted (CUDA) or ran successfully (CPU),
            False when it failed (its failure is reported as a ``TransferResult``).

        Raises:
            ValueError: when nothing is registered, a job id repeats in ``jobs`` or is still
                pending (in flight, or its result not taken yet), a job's sides have the same
                type or do not describe the same blocks, or the jobs mix stores and loads.
                Checked before anything is copied: then no job of the call is submitted.
            TypeError: an entry that is not a ``(job_id, src, dst)`` triple, or a job id that
                is not an int.
            RuntimeError: after :meth:`close`.
        """
        if not self._groups:
            raise ValueError("no KV caches registered: call register_kv_caches first")
        entries = list(jobs)
        if not entries:
            return []
        self._check_open()
        seen: set[int] = set()
        pending = self.pending_jobs()  # in flight, or finished with the result not taken
        specs: list[tuple[int, GPUBlockSpec, CPUBlockSpec]] = []
        direction: Direction | None = None
        for k, entry in enumerate(entries):
            if not isinstance(entry, tuple) or len(entry) != 3:
                raise TypeError(
                    f"jobs[{k}] must be a (job_id, src, dst) tuple, got {entry!r}; nothing was "
                    "submitted"
                )
            job_id, src, dst = entry
            job_id = _job_id(job_id, f"jobs[{k}]")
            if job_id in pending or job_id in seen:
                raise ValueError(
                    f"job_id {job_id} (jobs[{k}]) is still pending (in flight, or its result not "
                    "taken yet) or repeats in jobs; use a fresh job id per job. Nothing was "
                    "submitted"
                )
            seen.add(job_id)
            d, gpu, cpu = _sides(src, dst)
            if direction is None:
                direction = d
            elif d != direction:
                raise ValueError(
                    f"jobs[{k}] (job {job_id}) is a {d} but jobs[0] is a {direction}: submit "
                    "stores and loads in separate calls. Nothing was submitted"
                )
            specs.append((job_id, gpu, cpu))
        assert direction is not None
        if len(specs) == 1:
            return [self.transfer_async(*entries[0])]
        t0 = time.perf_counter()
        ok = [False] * len(specs)
        combined: list[tuple[np.ndarray, np.ndarray]] | None
        try:  # a plain ValueError (sides that do not match) goes to the caller: nothing done
            combined, job_bytes = self._expand_many(specs)
        except _CPUBlockOutOfRange:  # raised once every job's sides are known to match
            combined = None
        if combined is not None:
            try:  # every id in range and no destination twice, over all the jobs at once
                self._check_ids(direction, combined)
            except ValueError:
                combined = None
        if combined is None:  # find the bad jobs (the usual case never gets here)
            picked = self._isolate(direction, specs, entries, ok, t0)
            if picked is None:
                return ok
            members, combined = picked
        else:
            members = [
                (k, spec[0], nb) for k, (spec, nb) in enumerate(zip(specs, job_bytes, strict=True))
            ]
        cuda = self._device is not None and self._device.type == "cuda"
        try:
            mechanisms = [
                self._resolve_mechanism(direction, g, ids) if len(ids[0]) else ""
                for g, ids in zip(self._groups, combined, strict=True)
            ]
        except (RuntimeError, ValueError, IndexError) as exc:
            self._fail([job_id for _, job_id, _ in members], direction, str(exc))
            return ok
        used = "+".join(sorted({m for m in mechanisms if m}))
        if cuda:
            submitted = self._submit_cuda(
                [(job_id, nb) for _, job_id, nb in members], direction, combined, mechanisms, used
            )
            for k, _, _ in members:
                ok[k] = submitted
            return ok
        try:
            self._run(direction, combined, mechanisms)
        except (RuntimeError, ValueError, IndexError) as exc:  # pragma: no cover - checked
            self._fail([job_id for _, job_id, _ in members], direction, str(exc))
            return ok
        seconds = time.perf_counter() - t0
        label = "staged" if "staged" in mechanisms else "cpu"
        shares = _shares([nb for _, _, nb in members])
        for (k, job_id, nb), share in zip(members, shares, strict=True):
            self._finished.append(
                _trusted(TransferResult, job_id=job_id, direction=direction, success=True,
                         num_bytes=nb, seconds=seconds * share, error=None, mechanism=label)
            )  # fmt: skip
            ok[k] = True
        return ok

    def _expand_many(
        self, specs: list[tuple[int, GPUBlockSpec, CPUBlockSpec]]
    ) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[int]]:
        """:meth:`_expand` of several jobs at once, concatenated per group (GPU block ids, CPU
        sub-block rows), and each job's bytes: a few list operations per job, the arithmetic
        once over all of them.

        Raises:
            ValueError: a job whose sides do not describe the same blocks (:meth:`_expand`'s
                message, prefixed with the job).
            _CPUBlockOutOfRange: a CPU block id past the pool (``block_size_factor`` > 1),
                once every job's sides are known to match.
        """
        f = self.block_size_factor
        num_groups = len(self._groups)
        gpu_parts: list[list[tuple[int, ...]]] = [[] for _ in range(num_groups)]
        cpu_parts: list[list[tuple[int, ...]]] = [[] for _ in range(num_groups)]
        runs: list[list[tuple[int, int, int]]] = [[] for _ in range(num_groups)]
        cpu_base = [0] * num_groups  # CPU ids of each group so far, over the jobs
        job_bytes = []
        if num_groups == 1 and f == 1:  # the usual case: a job's ids are the rows
            row_bytes = self._groups[0].row_bytes
            for k, (job_id, gpu, cpu) in enumerate(specs):
                n = len(gpu.block_ids)
                if len(cpu.block_ids) != n or len(gpu.group_sizes) != 1:
                    self._expand_error(k, job_id, gpu, cpu)
                gpu_parts[0].append(gpu.block_ids)
                cpu_parts[0].append(cpu.block_ids)
                job_bytes.append(n * row_bytes)
        else:
            for k, (job_id, gpu, cpu) in enumerate(specs):
                gpu_off = cpu_off = num_bytes = 0
                fits = len(gpu.group_sizes) == num_groups
                pairs = zip(gpu.group_sizes, gpu.block_indices, strict=True)
                for g, (n, start) in enumerate(pairs):
                    if not fits or n == 0:
                        continue
                    first = start // f
                    count = (start + n - 1) // f - first + 1
                    if cpu_off + count > len(cpu.block_ids):
                        fits = False
                        break
                    gpu_parts[g].append(gpu.block_ids[gpu_off : gpu_off + n])
                    cpu_parts[g].append(cpu.block_ids[cpu_off : cpu_off + count])
                    runs[g].append((n, start, cpu_base[g] - first))
                    cpu_base[g] += count
                    num_bytes += n * self._groups[g].row_bytes
                    gpu_off += n
                    cpu_off += count
                if not fits or cpu_off != len(cpu.block_ids):
                    self._expand_error(k, job_id, gpu, cpu)
                job_bytes.append(num_bytes)
        combined = []
        for g in range(num_groups):
            gpu_ids = np.fromiter(itertools.chain.from_iterable(gpu_parts[g]), dtype=np.int64)
            cpu_ids = np.fromiter(itertools.chain.from_iterable(cpu_parts[g]), dtype=np.int64)
            if f == 1 or len(gpu_ids) == 0:
                combined.append((gpu_ids, cpu_ids if f == 1 else _EMPTY_IDS))
                continue
            # every job's sides match (checked above); an id past the pool would wrap around
            # int64 in id × f below, so it fails the call here and each job is checked alone
            if (error := _cpu_range_error(cpu_ids, self.num_cpu_blocks)) is not None:
                raise error
            n, start, base = (np.array(c, dtype=np.int64) for c in zip(*runs[g], strict=True))
            offsets = np.arange(len(gpu_ids), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
            logical = np.repeat(start, n) + offsets
            rows = cpu_ids[np.repeat(base, n) + logical // f] * f + logical % f
            combined.append((gpu_ids, rows))
        return combined, job_bytes

    def _job_bytes(self, per_group: list[tuple[np.ndarray, np.ndarray]]) -> int:
        """Bytes a job of :meth:`_expand`'s ``per_group`` moves (its GPU blocks' rows)."""
        return sum(
            len(gpu_ids) * g.row_bytes
            for (gpu_ids, _), g in zip(per_group, self._groups, strict=True)
        )

    def _fail(
        self, job_ids: Sequence[int], direction: Direction, error: str, mechanism: str = "cpu"
    ) -> None:
        """Queues a failed :class:`TransferResult` (nothing moved) for each of ``job_ids``."""
        for job_id in job_ids:
            self._finished.append(
                TransferResult(job_id, direction, False, 0, 0.0, error, mechanism)
            )

    def _expand_error(self, k: int, job_id: int, gpu: GPUBlockSpec, cpu: CPUBlockSpec) -> None:
        """Raises :meth:`_expand`'s error for job ``k`` of a :meth:`transfer_many_async` call,
        prefixed with the job.

        Raises:
            ValueError: always (the sides do not describe the same blocks).
        """
        try:
            self._expand(gpu, cpu)  # the same checks: raises, naming the mismatch
        except ValueError as exc:
            raise ValueError(f"job {job_id} (jobs[{k}]): {exc}") from None
        raise AssertionError("_expand_many and _expand disagree")  # pragma: no cover

    def _isolate(
        self,
        direction: Direction,
        specs: list[tuple[int, GPUBlockSpec, CPUBlockSpec]],
        entries: list,
        ok: list[bool],
        t0: float,
    ) -> tuple[list[tuple[int, int, int]], list[tuple[np.ndarray, np.ndarray]]] | None:
        """:meth:`transfer_many_async` when the jobs' ids together fail the checks: each job
        is checked alone, a bad one fails alone (a failed ``TransferResult``); if the good ones
        still write one block twice they are submitted one by one, in order. Returns the good
        jobs ``(position, job id, bytes)`` and their concatenated ids, or None when nothing is
        left to submit together (``ok`` then holds the answers)."""
        members: list[tuple[int, int, int]] = []
        parts = []
        for k, (job_id, gpu, cpu) in enumerate(specs):
            try:  # the sides match (checked): only an id out of range raises
                per_group = self._expand(gpu, cpu)
                self._check_ids(direction, per_group)
            except ValueError as exc:  # this job alone fails, as in transfer_async
                self._finished.append(
                    TransferResult(job_id, direction, False, 0, time.perf_counter() - t0,
                                   str(exc))
                )  # fmt: skip
                continue
            members.append((k, job_id, self._job_bytes(per_group)))
            parts.append(per_group)
        if not members:
            return None
        combined = [
            (np.concatenate([p[g][0] for p in parts]), np.concatenate([p[g][1] for p in parts]))
            for g in range(len(self._groups))
        ]
        if self._repeated_destination(direction, combined) is not None:
            # two jobs write one block: one by one, in order (the later write wins)
            for k, _, _ in members:
                ok[k] = self.transfer_async(*entries[k])
            return None
        return members, combined

    def _run(
        self,
        direction: Direction,
        per_group: list[tuple[np.ndarray, np.ndarray]],
        mechanisms: list[str],
    ) -> None:
        """Enqueue (CUDA) or run (CPU) every group's copies; the lanes already wait for what
        they must."""
        dma, sm = self._dma[direction], self._sm[direction]
        on_gpu = self._device is not None and self._device.type == "cuda"
        for (gpu_ids, cpu_rows), g, mechanism in zip(
            per_group, self._groups, mechanisms, strict=True
        ):
            if len(gpu_ids) == 0:
                continue
            if mechanism == "staged":
                ring = self._ring(direction)
                sm_mechanism = "kernel" if on_gpu else "memcpy"
                dma_mechanism = self._dma_mechanism() if on_gpu else "memcpy"
                how = {"sm_mechanism": sm_mechanism, "dma_mechanism": dma_mechanism}
                staged = g.staged
                assert staged is not None  # made at registration
                if direction == "store":
                    staged_store(staged, gpu_ids, cpu_rows, ring, sm, dma, **how)
                else:
                    staged_load(staged, cpu_rows, gpu_ids, ring, sm, dma, **how)
                continue
            with dma.context():
                if direction == "store":
                    copy_blocks_fast(g.gpu_side, g.cpu_side, gpu_ids, cpu_rows, mechanism)
                else:
                    copy_blocks_fast(g.cpu_side, g.gpu_side, cpu_rows, gpu_ids, mechanism)

    def _check_ids(
        self, direction: Direction, per_group: list[tuple[np.ndarray, np.ndarray]]
    ) -> None:
        """Validate every group's ids before any copy, so a bad job writes nothing.

        Raises:
            ValueError: naming the group, the first bad id and the valid range, or a repeated
                destination id.
        """
        cpu_rows = self.num_cpu_blocks * self.block_size_factor
        for g, (gpu_ids, cpu_ids) in enumerate(per_group):
            if len(gpu_ids) == 0:
                continue
            for name, ids, limit, what in (
                ("GPU", gpu_ids, self.num_gpu_blocks, "GPU block ids"),
                (
                    "CPU block" if self.block_size_factor == 1 else "CPU row",
                    cpu_ids,
                    cpu_rows,
                    "CPU block ids"
                    if self.block_size_factor == 1
                    else "CPU rows (CPU block id × block_size_factor + offset)",
                ),
            ):
                if ids.min() < 0 or ids.max() >= limit:
                    first = int(ids[(ids < 0) | (ids >= limit)][0])
                    raise ValueError(
                        f"group {g}: {name} id {first} is out of range; {what} must be in "
                        f"[0, {limit}). The job was not run."
                    )
        if (repeat := self._repeated_destination(direction, per_group)) is not None:
            raise ValueError(f"{repeat}; two writes to one block would race. The job was not run.")

    def _repeated_destination(
        self, direction: Direction, per_group: list[tuple[np.ndarray, np.ndarray]]
    ) -> str | None:
        """Where a destination id (CPU row of a store, GPU block of a load) repeats: within a
        group, or in two groups that share a tensor (the same bytes written twice); None when
        none does."""
        dst_index = 1 if direction == "store" else 0
        for g, ids in enumerate(per_group):
            dst = ids[dst_index]
            unique = len(set(dst.tolist())) if len(dst) <= 256 else len(np.unique(dst))
            if unique != len(dst):
                return f"group {g}: a destination id repeats in {dst.tolist()}"
        for g, h in self._shared_pairs:
            both = np.intersect1d(per_group[g][dst_index], per_group[h][dst_index])
            if len(both):
                return (
                    f"groups {g} and {h} share a KV cache tensor and both write destination id "
                    f"{int(both[0])} (the same bytes)"
                )
        return None

    def job_chunks(self, per_group: list[tuple[np.ndarray, np.ndarray]]) -> tuple[int, int]:
        """``(num_chunks, num_bytes)`` of a job copied directly: a chunk is one run of blocks
        whose GPU and CPU row ids both go up by one, in one copied region (what one copy call
        moves)."""
        chunks = 0
        num_bytes = 0
        for (gpu_ids, cpu_ids), g in zip(per_group, self._groups, strict=True):
            chunks += _num_runs(gpu_ids, cpu_ids) * len(g.regions)
            num_bytes += len(gpu_ids) * g.row_bytes
        return chunks, num_bytes

    def _dma_mechanism(self) -> str:
        if self._batch_supported is None:
            self._batch_supported = batch_copy_supported()
        return "batch" if self._batch_supported else "memcpy"

    def _resolve_mechanism(
        self, direction: Direction, group: _Group, ids: tuple[np.ndarray, np.ndarray]
    ) -> str:
        """The mechanism of one group of a job (``self.mechanism`` unless it is ``"auto"``).

        Raises:
            ValueError: when ``"staged"`` is forced and the staging buffer cannot hold one GPU
                block of all layers.
        """
        on_gpu = self._device is not None and self._device.type == "cuda"
        if self.mechanism != "auto":
            if self.mechanism == "staged":
                self._ring(direction)  # allocated (or refused) before any copy
            return self.mechanism
        if not on_gpu:
            return "memcpy"  # the CPU op's parallel memcpy; staging would only add a pass
        gpu_ids, cpu_rows = ids
        n = len(gpu_ids)
        chunks = _num_runs(gpu_ids, cpu_rows) * len(group.regions)
        staged_chunk = None
        if group.layout == "layer_major" and self.staging_bytes:
            used = sum(length for _, length in group.cpu_runs)
            staged_chunk = n * used / (_num_runs(cpu_rows) * len(group.cpu_runs))
        if self._batch_supported is None:
            self._batch_supported = batch_copy_supported()
        choice = choose_mechanism(
            n * group.row_bytes / max(chunks, 1),
            chunks,
            direction,
            self.thresholds or default_thresholds(),
            batch_supported=self._batch_supported,
            budget=self.compute_slowdown_budget,
            staged_chunk_bytes=staged_chunk,
        )
        if choice.mechanism == "staged":
            self._ring(direction)
        return choice.mechanism

    def _submit_cuda(
        self,
        members: list[tuple[int, int]],
        direction: Direction,
        per_group: list[tuple[np.ndarray, np.ndarray]],
        mechanisms: list[str],
        used: str,
    ) -> bool:
        """Enqueue the copies of ``per_group`` for the jobs ``members`` (``(job_id,
        num_bytes)``; several for :meth:`transfer_many_async`), all ending on one event."""
        dma, sm = self._dma[direction], self._sm[direction]
        # both lanes wait for the compute stream: a store reads blocks the forward pass wrote;
        # a load overwrites blocks that earlier compute work may still write or read (a block
        # freed after the last step and handed to this request: found on an H200 by
        # `kvoff replay --device cuda`, whose loads were overwritten by the previous request's
        # pending writes into the same blocks: 88-226 corrupted GPU blocks per 300 requests)
        compute = torch.cuda.current_stream(self._device)
        dma.wait_stream(compute)
        sm.wait_stream(compute)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        first = sm if direction == "store" and "staged" in mechanisms else dma
        first.record(start)
        try:
            self._run(direction, per_group, mechanisms)
        except (RuntimeError, ValueError, IndexError) as exc:  # pragma: no cover - CUDA errors
            # ids were checked first; a CUDA failure here leaves earlier pieces enqueued, so
            # wait for them before the job is reported failed (never a hit).
            torch.cuda.synchronize(self._device)
            self._fail([job_id for job_id, _ in members], direction, str(exc), used)
            return False
        # The job ends where its last copy ends: on the DMA lane for a store (a staged piece's
        # DMA waits for its gather), on the SM lane for a staged load (whose end first waits for
        # the load's copies on the DMA lane).
        last = sm if direction == "load" and "staged" in mechanisms else dma
        if last is sm:
            sm.wait_stream(dma.stream)
        last.record(end)
        shares = _shares([num_bytes for _, num_bytes in members])
        for (job_id, num_bytes), share in zip(members, shares, strict=True):
            self._in_flight[job_id] = _InFlight(
                job_id, direction, num_bytes, used, start, end, share
            )
        return True

    def _complete(self, job: _InFlight) -> TransferResult:
        del self._in_flight[job.job_id]
        seconds = job.start.elapsed_time(job.end) / 1e3 * job.share
        return TransferResult(
            job.job_id, job.direction, True, job.num_bytes, seconds, None, job.mechanism
        )

    def pending_jobs(self) -> set[int]:
        """Ids of submitted jobs whose results were not taken yet (by :meth:`get_finished` or
        :meth:`wait`): in flight, or finished and queued."""
        return set(self._in_flight) | {r.job_id for r in self._finished}

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, without blocking (CUDA events are polled)."""
        done = self._finished
        self._finished = []
        for job in list(self._in_flight.values()):
            if job.end.query():
                done.append(self._complete(job))
        return done

    def wait(self, job_ids: Iterable[int]) -> list[TransferResult]:
        """Block until the given jobs are finished and return their results.

        Results of these jobs are removed from what :meth:`get_finished` will return; results
        of other jobs stay queued.

        Raises:
            KeyError: for a job id that was never submitted or whose result was already taken
                (checked before waiting: then no result is taken, every job stays reportable).
            ValueError: a job id given more than once (each result is reported once; nothing
                is taken).
        """
        wanted = list(job_ids)
        wanted_set = set(wanted)
        if len(wanted_set) != len(wanted):
            seen: set[int] = set()
            repeated = sorted({j for j in wanted if j in seen or seen.add(j)})
            raise ValueError(
                f"job ids {repeated} are given more than once; list each job once (its result "
                "is reported once); nothing was taken"
            )
        finished = {r.job_id for r in self._finished}
        missing = [j for j in wanted if j not in self._in_flight and j not in finished]
        if missing:
            raise KeyError(
                f"unknown job ids {missing}: never submitted, or their results were already "
                "taken; nothing was taken"
            )
        results: dict[int, TransferResult] = {}
        for jid in wanted:
            job = self._in_flight.get(jid)
            if job is not None:
                job.end.synchronize()
                results[jid] = self._complete(job)
        keep = []
        for r in self._finished:
            if r.job_id in wanted_set and r.job_id not in results:
                results[r.job_id] = r
            else:
                keep.append(r)
        self._finished = keep
        return [results[j] for j in wanted]
