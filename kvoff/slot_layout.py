"""The slot layout: where each registered GPU block row lands in a CPU slot, and a job's block
ids as the rows a copy moves.

This is the pool and layout arithmetic of :class:`kvoff.OffloadingWorker`, kept apart from the
copying.

**GPU rows** (docs/design.md "Moving bytes"): each registered tensor is viewed as
``(num_gpu_blocks, row_bytes)`` uint8 rows, using the engine's ``num_gpu_blocks`` (never the
tensor's leading dimension: docs/design.md invariant 2). Views over the same bytes (a tensor shared
by layers of several groups) form one *canonical* tensor.

**The CPU pool is slot-major.** One CPU block (slot) is one contiguous region of
``slot_bytes = block_size_factor × bytes_per_gpu_block``: ``block_size_factor`` sub-blocks, each
holding one GPU block of every canonical tensor, in registration order. GPU block ``i`` of
offloaded block ``j`` lands in sub-block ``cpu_block_id × block_size_factor + i %
block_size_factor``. So one GPU block of all layers is one contiguous chunk on the CPU side, and
one offloaded block is one contiguous object (:meth:`kvoff.OffloadingWorker.cpu_slot`), the unit a
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

What this module computes:

* :func:`layer_plan` says which KV cache group (and spec) each registered layer belongs to;
* :func:`plan_slot` turns the block-row views of the registered tensors into KV cache groups
  of copied regions: views over the same bytes are one *canonical* tensor with one place in the
  sub-block, and views adjacent both in the GPU block and in the sub-block merge into one
  region;
* :func:`attach_pool` gives every region its rows in the allocated pool;
* :func:`expand` and :func:`expand_many` turn a job's :class:`~kvoff.jobs.GPUBlockSpec` and
  :class:`~kvoff.jobs.CPUBlockSpec` into, per group, the GPU block ids and the CPU sub-block
  rows (``cpu_block_id × block_size_factor + logical_index % block_size_factor``) to copy, and
  :func:`check_ids` refuses ids out of range or written twice before anything is copied.

It holds no tensor of its own and runs no copy: the tensors it sees are the views the worker
gives it (``torch`` is only needed for their type).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvoff.jobs import CPUBlockSpec, GPUBlockSpec
from kvoff.sizing import bytes_per_gpu_block
from kvoff.transfer import Direction

if TYPE_CHECKING:
    import torch

    from kvoff.specs import KVCacheConfig
    from kvoff.staging import StagedGroup

__all__ = [
    "GPU_LAYOUTS",
    "CPUBlockOutOfRange",
    "Group",
    "IdsPerGroup",
    "Region",
    "SlotPlan",
    "attach_pool",
    "check_ids",
    "expand",
    "expand_many",
    "job_bytes",
    "layer_plan",
    "num_runs",
    "plan_slot",
    "repeated_destination",
    "sub_block_bytes",
]

GPU_LAYOUTS: tuple[str, ...] = ("block_contiguous", "layer_major")
"""The GPU layouts a KV cache group can have (see :mod:`kvoff.worker`'s docstring)."""

EMPTY_IDS = np.empty(0, dtype=np.int64)
"""The ids of a group with no block in a job (read only: shared by every such job)."""

IdsPerGroup = list[tuple[np.ndarray, np.ndarray]]
"""Per KV cache group, ``(GPU block ids, CPU sub-block rows)`` as int64 arrays of one length."""


class CPUBlockOutOfRange(ValueError):
    """A job's CPU block id is not in ``[0, num_cpu_blocks)``: the job fails (a failed
    :class:`~kvoff.jobs.TransferResult`), as for any out-of-range id, and nothing of it is
    copied."""


def cpu_range_error(cpu_ids: np.ndarray, num_cpu_blocks: int) -> CPUBlockOutOfRange | None:
    """The error for the first CPU block id of ``cpu_ids`` (int64) at or above
    ``num_cpu_blocks``, or None when every id is in range (ids are already known to be >= 0)."""
    if len(cpu_ids) == 0 or cpu_ids.max() < num_cpu_blocks:
        return None
    first = int(cpu_ids[cpu_ids >= num_cpu_blocks][0])
    return CPUBlockOutOfRange(
        f"CPU block id {first} is out of range; CPU block ids must be in [0, {num_cpu_blocks}). "
        "The job was not run."
    )


@dataclass
class Region:
    """One copied byte region of a block: GPU rows and their place in the slot."""

    gpu_rows: torch.Tensor  # (num_gpu_blocks, row_bytes) uint8 view of the GPU cache
    cpu_offset: int  # byte offset inside a sub-block
    row_bytes: int
    cpu_rows: torch.Tensor | None = None  # (num_cpu_blocks × f, row_bytes) view of the pool


@dataclass
class Group:
    """One KV cache group's regions and the slot byte ranges they use."""

    views: list[Region] = field(default_factory=list)  # one per registered row view
    regions: list[Region] = field(default_factory=list)  # views merged where adjacent
    row_bytes: int = 0  # bytes per GPU block of this group (sum of its views' rows)
    cpu_runs: list[tuple[int, int]] = field(default_factory=list)  # used slot byte ranges
    cpu_run_rows: list[torch.Tensor] = field(default_factory=list)
    gpu_side: list[torch.Tensor] = field(default_factory=list)  # regions' GPU rows
    cpu_side: list[torch.Tensor] = field(default_factory=list)  # regions' CPU rows

    @property
    def layout(self) -> str:
        """``"block_contiguous"`` (one region per block) or ``"layer_major"``
        (:data:`GPU_LAYOUTS`)."""
        return "block_contiguous" if len(self.regions) == 1 else "layer_major"

    staged: StagedGroup | None = None  # what a staged copy of this group needs (made once)


@dataclass(frozen=True)
class SlotPlan:
    """What :func:`plan_slot` found.

    Attributes:
        groups: per KV cache group, its regions (CPU rows not attached yet).
        canonical_row_bytes: per canonical tensor, in registration order, the widest row any
            layer copies from it (bytes per GPU block).
        shared_pairs: pairs of groups with a canonical tensor in common (hybrid models): a
            destination id in both writes the same bytes.
    """

    groups: list[Group]
    canonical_row_bytes: list[int]
    shared_pairs: list[tuple[int, int]]

    @property
    def sub_block(self) -> int:
        """Bytes of one sub-block of a slot: one GPU block of every canonical tensor."""
        return sub_block_bytes(self.canonical_row_bytes)


def sub_block_bytes(canonical_row_bytes: Sequence[int]) -> int:
    """Bytes one GPU block id costs over canonical tensors whose rows (one per GPU block) are
    ``canonical_row_bytes`` long: :func:`kvoff.sizing.bytes_per_gpu_block` of tensors of one
    row each."""
    return bytes_per_gpu_block(canonical_row_bytes, 1)


def _adjacent(a: Region, b: Region) -> bool:
    """Whether region ``b`` continues region ``a`` in both the GPU cache and the slot."""
    ga, gb = a.gpu_rows, b.gpu_rows
    return (
        ga.untyped_storage().data_ptr() == gb.untyped_storage().data_ptr()
        and ga.stride(0) == gb.stride(0)
        and gb.storage_offset() == ga.storage_offset() + a.row_bytes
        and (ga.shape[0] == 1 or a.row_bytes + b.row_bytes <= ga.stride(0))
        and b.cpu_offset == a.cpu_offset + a.row_bytes
    )


def _merge(a: Region, b: Region) -> Region:
    rows = a.gpu_rows.as_strided(
        (a.gpu_rows.shape[0], a.row_bytes + b.row_bytes),
        (a.gpu_rows.stride(0), 1),
        a.gpu_rows.storage_offset(),
    )
    return Region(rows, a.cpu_offset, a.row_bytes + b.row_bytes)


def layer_plan(
    config: KVCacheConfig | None,
    layer_names: Iterable[str],
    layer_to_group: Mapping[str, int] | None,
) -> tuple[dict[str, int], dict[str, object | None]]:
    """Layer → KV cache group and layer → spec, from the KVCacheConfig when there is one.

    Args:
        config: the engine's GPU cache plan, or None (then every layer's spec is None).
        layer_names: the registered layers (used without a ``config``).
        layer_to_group: the caller's layer → group index (without a ``config``: default all
            layers in group 0; with one it must agree with the config's groups).

    Raises:
        ValueError: ``layer_to_group`` disagrees with the config's groups.
    """
    if config is None:
        mapping = dict(layer_to_group or dict.fromkeys(layer_names, 0))
        return mapping, dict.fromkeys(mapping)
    mapping = {}
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


def plan_slot(views: Iterable[tuple[int, torch.Tensor]], num_groups: int) -> SlotPlan:
    """Group the registered block rows and give each its place in the slot's sub-block.

    Args:
        views: ``(group index, rows)`` for every block-row view of every registered layer, in
            registration order; ``rows`` is a ``(num_gpu_blocks, row_bytes)`` uint8 view
            (:func:`kvoff.registration.block_row_views`). Consumed once, in order (an error
            its producer raises goes to the caller).
        num_groups: KV cache groups (``views`` uses indices ``0..num_groups-1``).

    Returns:
        A :class:`SlotPlan`. Canonical tensors sit in the sub-block in the order they were
        first seen; a group's copied regions are its views, merged where adjacent in both the
        GPU block and the sub-block.
    """
    # Block rows over the same bytes (one tensor shared by layers of several groups, or
    # by several layers of one group) form ONE canonical tensor with ONE place in the slot:
    # a slot holds one offloaded block of one group, so a slot's bytes are the bytes one GPU
    # block id costs in the shared pool (invariant 3), not page × number of layers.
    canon: dict[tuple[int, int], int] = {}  # (address of row 0, row stride) -> index
    canon_rows: list[int] = []  # widest row any layer copies from that canonical tensor
    per_group: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(num_groups)]
    seen: set[tuple[int, int, int]] = set()  # (group, canonical, row bytes)
    for g, rows in views:
        key = (rows.data_ptr(), rows.stride(0))
        c = canon.setdefault(key, len(canon))
        if c == len(canon_rows):
            canon_rows.append(0)
        canon_rows[c] = max(canon_rows[c], rows.shape[1])
        if (g, c, rows.shape[1]) not in seen:
            seen.add((g, c, rows.shape[1]))
            per_group[g].append((c, rows))
    offsets = [sum(canon_rows[:c]) for c in range(len(canon_rows))]
    groups = [Group() for _ in range(num_groups)]
    for g, group_views in enumerate(per_group):
        group = groups[g]
        for c, rows in group_views:
            region = Region(rows, offsets[c], rows.shape[1])
            group.views.append(region)
            group.row_bytes += region.row_bytes
            if group.regions and _adjacent(group.regions[-1], region):
                group.regions[-1] = _merge(group.regions[-1], region)
            else:
                group.regions.append(Region(rows, offsets[c], rows.shape[1]))
        spans = sorted((r.cpu_offset, r.row_bytes) for r in group.views)
        for off, length in spans:
            if group.cpu_runs and group.cpu_runs[-1][0] + group.cpu_runs[-1][1] >= off:
                last_off, last_len = group.cpu_runs[-1]
                group.cpu_runs[-1] = (last_off, max(last_len, off + length - last_off))
            else:
                group.cpu_runs.append((off, length))
    canons = [{c for c, _ in group_views} for group_views in per_group]
    shared_pairs = [
        (g, h) for g in range(num_groups) for h in range(g + 1, num_groups) if canons[g] & canons[h]
    ]
    return SlotPlan(groups, canon_rows, shared_pairs)


def attach_pool(groups: Sequence[Group], pool: torch.Tensor, num_rows: int, sub_block: int) -> None:
    """Give every region, view and used slot byte range of ``groups`` its rows in the CPU pool.

    Args:
        groups: from :func:`plan_slot`; their ``cpu_rows``, ``cpu_run_rows``, ``gpu_side`` and
            ``cpu_side`` are set.
        pool: the CPU pool, ``num_rows × sub_block`` contiguous uint8 bytes.
        num_rows: sub-blocks in the pool (``num_cpu_blocks × block_size_factor``).
        sub_block: bytes of one sub-block (:attr:`SlotPlan.sub_block`).
    """

    def pool_rows(offset: int, length: int) -> torch.Tensor:
        # (num_rows, length) uint8 view: byte ``offset`` onwards of every sub-block
        return pool.as_strided((num_rows, length), (sub_block, 1), pool.storage_offset() + offset)

    for group in groups:
        for r in (*group.views, *group.regions):
            r.cpu_rows = pool_rows(r.cpu_offset, r.row_bytes)
        group.cpu_run_rows = [pool_rows(o, n) for o, n in group.cpu_runs]
        group.gpu_side = [r.gpu_rows for r in group.regions]
        group.cpu_side = [r.cpu_rows for r in group.regions]  # type: ignore[misc]


def num_runs(*ids: np.ndarray) -> int:
    """Runs of positions where every id list goes up by one (1 for one id, 0 for none)."""
    n = len(ids[0])
    if n == 0:
        return 0
    breaks = np.zeros(n - 1, dtype=bool)
    for t in ids:
        breaks |= np.diff(t) != 1
    return int(breaks.sum()) + 1


def expand(
    gpu: GPUBlockSpec,
    cpu: CPUBlockSpec,
    num_groups: int,
    block_size_factor: int,
    num_cpu_blocks: int,
) -> IdsPerGroup:
    """Per group: (GPU block ids, CPU sub-block rows) of one job, as int64 arrays.

    Raises:
        ValueError: the two sides do not describe the same blocks (group count, or how many
            CPU blocks the GPU side needs).
        CPUBlockOutOfRange: a CPU block id past the pool (``block_size_factor`` > 1; with 1
            the rows are the ids and the worker's id check names them).
    """
    if len(gpu.group_sizes) != num_groups:
        raise ValueError(
            f"the job has {len(gpu.group_sizes)} group_sizes entries but "
            f"{num_groups} KV cache groups are registered; give one per group"
        )
    f = block_size_factor
    out: IdsPerGroup = []
    gpu_ids = np.asarray(gpu.block_ids, dtype=np.int64)
    cpu_ids = np.asarray(cpu.block_ids, dtype=np.int64)
    # Rows are id × f + offset: an id past the pool is clamped first so that the product
    # cannot wrap around int64 into a valid row; the job then fails below, naming the id.
    safe = cpu_ids if f == 1 else np.minimum(cpu_ids, num_cpu_blocks)
    gpu_off = 0
    cpu_off = 0
    for n, start in zip(gpu.group_sizes, gpu.block_indices, strict=True):
        if n == 0:
            out.append((EMPTY_IDS, EMPTY_IDS))
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
    if f > 1 and (error := cpu_range_error(cpu_ids, num_cpu_blocks)) is not None:
        raise error
    return out


def _mismatch(
    k: int,
    job_id: int,
    gpu: GPUBlockSpec,
    cpu: CPUBlockSpec,
    num_groups: int,
    block_size_factor: int,
    num_cpu_blocks: int,
) -> None:
    """Raises :func:`expand`'s error for job ``k`` of an :func:`expand_many` call, prefixed with
    the job.

    Raises:
        ValueError: always (the sides do not describe the same blocks).
    """
    try:
        expand(gpu, cpu, num_groups, block_size_factor, num_cpu_blocks)  # names the mismatch
    except ValueError as exc:
        raise ValueError(f"job {job_id} (jobs[{k}]): {exc}") from None
    raise AssertionError("expand_many and expand disagree")  # pragma: no cover


def expand_many(
    specs: Sequence[tuple[int, GPUBlockSpec, CPUBlockSpec]],
    groups: Sequence[Group],
    block_size_factor: int,
    num_cpu_blocks: int,
) -> tuple[IdsPerGroup, list[int]]:
    """:func:`expand` of several jobs ``(job_id, gpu, cpu)`` at once, concatenated per group
    (GPU block ids, CPU sub-block rows), and each job's bytes: a few list operations per job,
    the arithmetic once over all of them.

    Raises:
        ValueError: a job whose sides do not describe the same blocks (:func:`expand`'s
            message, prefixed with the job).
        CPUBlockOutOfRange: a CPU block id past the pool (``block_size_factor`` > 1), once
            every job's sides are known to match.
    """
    f = block_size_factor
    num_groups = len(groups)
    gpu_parts: list[list[tuple[int, ...]]] = [[] for _ in range(num_groups)]
    cpu_parts: list[list[tuple[int, ...]]] = [[] for _ in range(num_groups)]
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(num_groups)]
    cpu_base = [0] * num_groups  # CPU ids of each group so far, over the jobs
    job_bytes_out = []

    if num_groups == 1 and f == 1:  # the usual case: a job's ids are the rows
        row_bytes = groups[0].row_bytes
        for k, (job_id, gpu, cpu) in enumerate(specs):
            n = len(gpu.block_ids)
            if len(cpu.block_ids) != n or len(gpu.group_sizes) != 1:
                _mismatch(k, job_id, gpu, cpu, num_groups, f, num_cpu_blocks)
            gpu_parts[0].append(gpu.block_ids)
            cpu_parts[0].append(cpu.block_ids)
            job_bytes_out.append(n * row_bytes)
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
                num_bytes += n * groups[g].row_bytes
                gpu_off += n
                cpu_off += count
            if not fits or cpu_off != len(cpu.block_ids):
                _mismatch(k, job_id, gpu, cpu, num_groups, f, num_cpu_blocks)
            job_bytes_out.append(num_bytes)
    combined = []
    for g in range(num_groups):
        gpu_ids = np.fromiter(itertools.chain.from_iterable(gpu_parts[g]), dtype=np.int64)
        cpu_ids = np.fromiter(itertools.chain.from_iterable(cpu_parts[g]), dtype=np.int64)
        if f == 1 or len(gpu_ids) == 0:
            combined.append((gpu_ids, cpu_ids if f == 1 else EMPTY_IDS))
            continue
        # every job's sides match (checked above); an id past the pool would wrap around
        # int64 in id × f below, so it fails the call here and each job is checked alone
        if (error := cpu_range_error(cpu_ids, num_cpu_blocks)) is not None:
            raise error
        n, start, base = (np.array(c, dtype=np.int64) for c in zip(*runs[g], strict=True))
        offsets = np.arange(len(gpu_ids), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        logical = np.repeat(start, n) + offsets
        rows = cpu_ids[np.repeat(base, n) + logical // f] * f + logical % f
        combined.append((gpu_ids, rows))
    return combined, job_bytes_out


def check_ids(
    direction: Direction,
    per_group: IdsPerGroup,
    num_gpu_blocks: int,
    num_cpu_blocks: int,
    block_size_factor: int,
    shared_pairs: Sequence[tuple[int, int]],
) -> None:
    """Validate every group's ids of a job before any copy, so a bad job writes nothing.

    Args:
        direction: ``"store"`` (the CPU rows are written) or ``"load"`` (the GPU blocks are).
        per_group: the job's ids (:func:`expand`).
        num_gpu_blocks: GPU blocks of the cache: GPU ids must be in ``[0, num_gpu_blocks)``.
        num_cpu_blocks, block_size_factor: CPU rows must be in
            ``[0, num_cpu_blocks × block_size_factor)``.
        shared_pairs: :attr:`SlotPlan.shared_pairs`.

    Raises:
        ValueError: naming the group, the first bad id and the valid range, or a repeated
            destination id.
    """
    cpu_rows = num_cpu_blocks * block_size_factor
    for g, (gpu_ids, cpu_ids) in enumerate(per_group):
        if len(gpu_ids) == 0:
            continue
        for name, ids, limit, what in (
            ("GPU", gpu_ids, num_gpu_blocks, "GPU block ids"),
            (
                "CPU block" if block_size_factor == 1 else "CPU row",
                cpu_ids,
                cpu_rows,
                "CPU block ids"
                if block_size_factor == 1
                else "CPU rows (CPU block id × block_size_factor + offset)",
            ),
        ):
            if ids.min() < 0 or ids.max() >= limit:
                first = int(ids[(ids < 0) | (ids >= limit)][0])
                raise ValueError(
                    f"group {g}: {name} id {first} is out of range; {what} must be in "
                    f"[0, {limit}). The job was not run."
                )
    if (repeat := repeated_destination(direction, per_group, shared_pairs)) is not None:
        raise ValueError(f"{repeat}; two writes to one block would race. The job was not run.")


def repeated_destination(
    direction: Direction, per_group: IdsPerGroup, shared_pairs: Sequence[tuple[int, int]]
) -> str | None:
    """Where a destination id (CPU row of a store, GPU block of a load) repeats: within a
    group, or in two groups that share a tensor (``shared_pairs``: the same bytes written
    twice); None when none does."""
    dst_index = 1 if direction == "store" else 0
    for g, ids in enumerate(per_group):
        dst = ids[dst_index]
        unique = len(set(dst.tolist())) if len(dst) <= 256 else len(np.unique(dst))
        if unique != len(dst):
            return f"group {g}: a destination id repeats in {dst.tolist()}"
    for g, h in shared_pairs:
        both = np.intersect1d(per_group[g][dst_index], per_group[h][dst_index])
        if len(both):
            return (
                f"groups {g} and {h} share a KV cache tensor and both write destination id "
                f"{int(both[0])} (the same bytes)"
            )
    return None


def job_bytes(per_group: IdsPerGroup, groups: Sequence[Group]) -> int:
    """Bytes a job of :func:`expand`'s ``per_group`` moves (its GPU blocks' rows)."""
    return sum(
        len(gpu_ids) * g.row_bytes for (gpu_ids, _), g in zip(per_group, groups, strict=True)
    )
