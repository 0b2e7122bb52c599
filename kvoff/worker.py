"""The worker: owns the CPU pool and moves blocks between it and the engine's GPU KV cache
(one job; the pool and layout arithmetic is in :mod:`kvoff.slot_layout`).

One worker runs per tensor-parallel rank. It registers the engine's KV cache tensors as block
rows, allocates the CPU pool (pinned when CUDA is available), and runs load (CPU→GPU) and store
(GPU→CPU) jobs through ``torch.ops.kvoff.copy_blocks``.

Each registered tensor is viewed as ``(num_gpu_blocks, row_bytes)`` uint8 block rows (never its
leading dimension: docs/design.md invariant 2); the CPU pool is slot-major (one CPU block, or
slot, is one contiguous ``block_size_factor × bytes_per_gpu_block`` region: the unit a disk or a
shared store keeps), and each KV cache group is ``block_contiguous`` or ``layer_major``
(:data:`GPU_LAYOUTS`). :mod:`kvoff.slot_layout` holds that arithmetic and describes it.

``mechanism="auto"`` picks, per job and group, the fastest way whose slowdown of concurrent
compute stays within ``compute_slowdown_budget`` (:func:`kvoff.transfer.choose_mechanism`).

On CPU builds jobs run synchronously inside :meth:`OffloadingWorker.transfer_async` (a parallel
memcpy; ``"staged"`` can be forced and runs the same staging logic with a CPU buffer). On CUDA
each direction has its own copy stream and its own SM stream (FIFO within a direction), every job
records events, and :meth:`OffloadingWorker.get_finished` polls them without blocking (the
pending jobs and their results are a :class:`kvoff.job_table.JobTable`).
:meth:`OffloadingWorker.transfer_many_async` submits one step's jobs of a direction together:
one copy per group and one pair of events for all of them, one result per job.

The CPU pool is one exact-size host allocation (no power-of-two rounding), page-locked by one call
when pinned (:class:`kvoff.pinned.HostPool`).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvoff.calibration import AutoThresholds, worker_thresholds
from kvoff.checks import check_flag
from kvoff.job_table import JobTable, byte_shares
from kvoff.jobs import (
    CPUBlockSpec,
    GPUBlockSpec,
    TransferResult,
    _is_index,
    _job_id,
    _job_ids,
    _sides,
    _trusted,
)
from kvoff.ops import batch_copy_supported, copy_blocks_fast
from kvoff.pinned import HostPool
from kvoff.registration import KVLayout, block_row_views
from kvoff.slot_layout import (
    GPU_LAYOUTS,
    CPUBlockOutOfRange,
    Group,
    IdsPerGroup,
    attach_pool,
    check_ids,
    expand,
    expand_many,
    job_bytes,
    layer_plan,
    num_runs,
    plan_slot,
    repeated_destination,
    sub_block_bytes,
)
from kvoff.staging import (
    Lane,
    StagedGroup,
    StagingRing,
    staged_load,
    staged_store,
)
from kvoff.transfer import (
    ALL_MECHANISMS,
    DEFAULT_COMPUTE_SLOWDOWN_BUDGET,
    DEFAULT_STAGING_BYTES,
    DEFAULT_STAGING_PIECE_BYTES,
    Direction,
    TransferThresholds,
    choose_mechanism,
    default_thresholds,
)

if TYPE_CHECKING:
    from kvoff.config import OffloadingConfig
    from kvoff.offloading_spec import CPUOffloadingSpec
    from kvoff.specs import KVCacheConfig

__all__ = ["GPU_LAYOUTS", "CPUBlockSpec", "GPUBlockSpec", "OffloadingWorker", "TransferResult"]


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
        thresholds: what ``"auto"`` decides from (default: ``$KVOFF_TRANSFER_THRESHOLDS``, else
            a calibration of this GPU and layout, cached or measured in the background from
            registration on with the packaged H100 measurement until it is done:
            :mod:`kvoff.calibration`).
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
        attach_shared_memory: with ``shared_memory_name``, map the existing pool of that name
            (a node pool, :mod:`kvoff.node_pool`) instead of creating it; it must have
            ``num_cpu_blocks`` slots of this worker's slot size (else
            :class:`kvoff.pinned.SharedMemoryError` at registration).

    Raises:
        ValueError: on non-positive sizes, a negative budget or staging size, or an unknown
            mechanism.
        TypeError: a size that is not an int (or a bool), a budget that is not a number, a
            flag (``pin_memory``, ``attach_shared_memory``) that is not a bool.
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
        attach_shared_memory: bool = False,
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
        check_flag("pin_memory", pin_memory, none_ok=True)
        check_flag("attach_shared_memory", attach_shared_memory)
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
        self.attach_shared_memory = attach_shared_memory
        self._pool: HostPool | None = None
        self._pool_tensor: torch.Tensor | None = None
        self._batch_supported: bool | None = None
        self._groups: list[Group] = []
        # pairs of groups with a canonical tensor in common (hybrid models): a destination id
        # in both writes the same bytes
        self._shared_pairs: list[tuple[int, int]] = []
        self._layer_names: list[str] = []
        self._canonical_row_bytes: list[int] = []
        self._device: torch.device | None = None
        self._jobs = JobTable()
        self._dma: dict[Direction, Lane] = {}
        self._sm: dict[Direction, Lane] = {}
        self._rings: dict[Direction, StagingRing] = {}
        self._auto: AutoThresholds | None = None  # auto's thresholds when none were given
        self._closed = False

    @classmethod
    def from_spec(
        cls,
        spec: CPUOffloadingSpec,
        *,
        pin_memory: bool | None = None,
        config: OffloadingConfig | None = None,
        shared_memory_name: str | None = None,
        attach_shared_memory: bool = False,
    ) -> OffloadingWorker:
        """A worker for one rank of the plan ``spec`` (a :class:`kvoff.CPUOffloadingSpec`): GPU
        blocks from its ``KVCacheConfig.num_blocks``, CPU slots and block_size_factor from the
        same spec the scheduler uses, so every rank's pool matches the scheduler's count.
        ``config`` (an :class:`kvoff.OffloadingConfig`) supplies the pinning and transfer options
        (:meth:`~kvoff.OffloadingConfig.worker_options`); an explicit ``pin_memory`` wins.
        ``shared_memory_name`` and ``attach_shared_memory`` are passed on (see the class).

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
            attach_shared_memory=attach_shared_memory,
            **options,
        )

    # ------------------------------------------------------------------ registration
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
        mapping, specs = layer_plan(self.kv_cache_config, kv_caches, layer_to_group)
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
        plan = plan_slot(
            (
                (mapping[name], rows)
                for name, kv in kv_caches.items()
                for rows in block_row_views(name, kv, self.num_gpu_blocks, specs[name], kv_layout)
            ),
            num_groups,
        )
        groups, canon_rows, sub_block = plan.groups, plan.canonical_row_bytes, plan.sub_block
        device = next(iter(devices))
        layer_major = any(g.layout == "layer_major" for g in groups)
        if device.type == "cuda" and layer_major and self.staging_bytes:
            self._check_staging_size(sub_block)

        f = self.block_size_factor
        pool = HostPool(
            [(self.num_cpu_blocks, sub_block * f)],
            pin=self.pin_memory,
            shared_name=self.shared_memory_name,
            attach=self.attach_shared_memory,
            description=(
                f"the CPU pool ({self.num_cpu_blocks} CPU blocks of {sub_block * f} bytes: "
                f"{f} x {sub_block} bytes per GPU block over {len(canon_rows)} tensors)"
            ),
        )
        (pool_tensor,) = pool.tensors
        attach_pool(groups, pool_tensor, self.num_cpu_blocks * f, sub_block)
        for group in groups:
            group.staged = StagedGroup(
                group.gpu_side, [r.cpu_offset for r in group.regions], group.cpu_runs,
                group.cpu_run_rows,
            )  # fmt: skip
        self._pool = pool
        self._pool_tensor = pool_tensor
        self._canonical_row_bytes = canon_rows
        self._groups = groups
        self._shared_pairs = plan.shared_pairs
        self._layer_names = list(kv_caches)
        self._device = device
        self._dma = {"store": Lane(device), "load": Lane(device)}
        self._sm = {"store": Lane(device), "load": Lane(device)}
        if device.type == "cuda" and layer_major and self.staging_bytes:
            for direction in ("store", "load"):
                self._ring(direction)
        if device.type == "cuda" and self.mechanism == "auto" and self.thresholds is None:
            # cached, or a probe in a background thread: never on the engine's path
            self._auto = worker_thresholds(
                device, "layer_major" if layer_major else "block_contiguous"
            )

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
        ``CPUOffloadingSpec.kv_bytes_per_block`` without padding (both are
        :func:`kvoff.sizing.bytes_per_gpu_block`)."""
        return sub_block_bytes(self._canonical_row_bytes)

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
        self._jobs.drain()
        if self._pool is not None:
            self._pool.close()
        if self._auto is not None:
            self._auto.wait(2 * self._auto.budget_s)  # a probe still on the GPU: bounded
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
    def _expand(self, gpu: GPUBlockSpec, cpu: CPUBlockSpec) -> IdsPerGroup:
        """Per group: (GPU block ids, CPU sub-block rows) as int64 arrays
        (:func:`kvoff.slot_layout.expand`)."""
        return expand(gpu, cpu, len(self._groups), self.block_size_factor, self.num_cpu_blocks)

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
        if self._jobs.is_pending(job_id):
            raise ValueError(
                f"job_id {job_id} is still pending (in flight, or its result not taken yet by "
                "get_finished or wait); use a fresh job id"
            )
        self._check_open()
        direction, gpu, cpu = _sides(src, dst)
        t0 = time.perf_counter()
        try:
            per_group = self._expand(gpu, cpu)
        except CPUBlockOutOfRange as exc:
            self._jobs.finish(
                TransferResult(job_id, direction, False, 0, time.perf_counter() - t0, str(exc))
            )
            return False
        num_bytes = job_bytes(per_group, self._groups)
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
            self._jobs.finish(
                TransferResult(job_id, direction, False, 0, time.perf_counter() - t0, str(exc))
            )
            return False
        used = "+".join(sorted({m for m in mechanisms if m}))
        if not cuda:
            try:
                self._run(direction, per_group, mechanisms)
            except (RuntimeError, ValueError, IndexError) as exc:  # pragma: no cover - checked
                self._jobs.finish(
                    TransferResult(job_id, direction, False, 0, time.perf_counter() - t0, str(exc))
                )
                return False
            label = "staged" if "staged" in mechanisms else "cpu"
            self._jobs.finish(
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
        pending = self._jobs.pending()  # in flight, or finished with the result not taken
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
        combined: IdsPerGroup | None
        try:  # a plain ValueError (sides that do not match) goes to the caller: nothing done
            combined, bytes_each = expand_many(
                specs, self._groups, self.block_size_factor, self.num_cpu_blocks
            )
        except CPUBlockOutOfRange:  # raised once every job's sides are known to match
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
                (k, spec[0], nb) for k, (spec, nb) in enumerate(zip(specs, bytes_each, strict=True))
            ]
        cuda = self._device is not None and self._device.type == "cuda"
        try:
            mechanisms = [
                self._resolve_mechanism(direction, g, ids) if len(ids[0]) else ""
                for g, ids in zip(self._groups, combined, strict=True)
            ]
        except (RuntimeError, ValueError, IndexError) as exc:
            self._jobs.fail([job_id for _, job_id, _ in members], direction, str(exc))
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
            self._jobs.fail([job_id for _, job_id, _ in members], direction, str(exc))
            return ok
        seconds = time.perf_counter() - t0
        label = "staged" if "staged" in mechanisms else "cpu"
        shares = byte_shares([nb for _, _, nb in members])
        for (k, job_id, nb), share in zip(members, shares, strict=True):
            self._jobs.finish(
                _trusted(TransferResult, job_id=job_id, direction=direction, success=True,
                         num_bytes=nb, seconds=seconds * share, error=None, mechanism=label)
            )  # fmt: skip
            ok[k] = True
        return ok

    def _isolate(
        self,
        direction: Direction,
        specs: list[tuple[int, GPUBlockSpec, CPUBlockSpec]],
        entries: list,
        ok: list[bool],
        t0: float,
    ) -> tuple[list[tuple[int, int, int]], IdsPerGroup] | None:
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
                self._jobs.finish(
                    TransferResult(job_id, direction, False, 0, time.perf_counter() - t0,
                                   str(exc))
                )  # fmt: skip
                continue
            members.append((k, job_id, job_bytes(per_group, self._groups)))
            parts.append(per_group)
        if not members:
            return None
        combined = [
            (np.concatenate([p[g][0] for p in parts]), np.concatenate([p[g][1] for p in parts]))
            for g in range(len(self._groups))
        ]
        if repeated_destination(direction, combined, self._shared_pairs) is not None:
            # two jobs write one block: one by one, in order (the later write wins)
            for k, _, _ in members:
                ok[k] = self.transfer_async(*entries[k])
            return None
        return members, combined

    def _run(
        self,
        direction: Direction,
        per_group: IdsPerGroup,
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

    def _check_ids(self, direction: Direction, per_group: IdsPerGroup) -> None:
        """:func:`kvoff.slot_layout.check_ids` against this worker's pool and groups.

        Raises:
            ValueError: naming the group, the first bad id and the valid range, or a repeated
                destination id.
        """
        check_ids(
            direction, per_group, self.num_gpu_blocks, self.num_cpu_blocks,
            self.block_size_factor, self._shared_pairs,
        )  # fmt: skip

    def job_chunks(self, per_group: IdsPerGroup) -> tuple[int, int]:
        """``(num_chunks, num_bytes)`` of a job copied directly: a chunk is one run of blocks
        whose GPU and CPU row ids both go up by one, in one copied region (what one copy call
        moves)."""
        chunks = 0
        num_bytes = 0
        for (gpu_ids, cpu_ids), g in zip(per_group, self._groups, strict=True):
            chunks += num_runs(gpu_ids, cpu_ids) * len(g.regions)
            num_bytes += len(gpu_ids) * g.row_bytes
        return chunks, num_bytes

    def _dma_mechanism(self) -> str:
        if self._batch_supported is None:
            self._batch_supported = batch_copy_supported()
        return "batch" if self._batch_supported else "memcpy"

    def _resolve_mechanism(
        self, direction: Direction, group: Group, ids: tuple[np.ndarray, np.ndarray]
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
        chunks = num_runs(gpu_ids, cpu_rows) * len(group.regions)
        staged_chunk = None
        if group.layout == "layer_major" and self.staging_bytes:
            used = sum(length for _, length in group.cpu_runs)
            staged_chunk = n * used / (num_runs(cpu_rows) * len(group.cpu_runs))
        if self._batch_supported is None:
            self._batch_supported = batch_copy_supported()
        choice = choose_mechanism(
            n * group.row_bytes / max(chunks, 1),
            chunks,
            direction,
            self.thresholds
            or (default_thresholds() if self._auto is None else self._auto.current()),
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
        per_group: IdsPerGroup,
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
            self._jobs.fail([job_id for job_id, _ in members], direction, str(exc), used)
            return False
        # The job ends where its last copy ends: on the DMA lane for a store (a staged piece's
        # DMA waits for its gather), on the SM lane for a staged load (whose end first waits for
        # the load's copies on the DMA lane).
        last = sm if direction == "load" and "staged" in mechanisms else dma
        if last is sm:
            sm.wait_stream(dma.stream)
        last.record(end)
        self._jobs.launch(members, direction, used, start, end)
        return True

    def pending_jobs(self) -> set[int]:
        """Ids of submitted jobs whose results were not taken yet (by :meth:`get_finished` or
        :meth:`wait`): in flight, or finished and queued."""
        return self._jobs.pending()

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, without blocking (CUDA events are polled)."""
        return self._jobs.take_finished()

    def fence(self, job_ids: Iterable[int], stream: torch.cuda.Stream | None = None) -> int:
        """Orders the work queued next on ``stream`` after the given jobs, without blocking the
        host (docs/design.md invariant 4: a GPU block is not rewritten while a job still reads
        or writes it).

        On CUDA, ``stream`` (default: the current stream of the worker's device, the engine's
        compute stream) waits on each job's end event: the host goes on launching work, and the
        forward pass that rewrites the jobs' GPU blocks starts when they are done. Jobs queued
        later on the worker's own streams are ordered too, since they wait on the compute
        stream when submitted. On CPU a job is done when :meth:`transfer_async` returns, so
        there is nothing to wait for. Either way the results are not taken: they come from
        :meth:`get_finished` (or :meth:`wait`) as usual.

        Args:
            job_ids: ids of submitted jobs whose results were not taken yet; a job given twice
                is waited on once.
            stream: the CUDA stream to order; ignored on CPU.

        Returns:
            The number of jobs still in flight that ``stream`` now waits on (0 on CPU).

        Raises:
            KeyError: for a job id that was never submitted or whose result was already taken
                (checked before any wait is queued: then nothing is ordered).
            TypeError: ``job_ids`` is not a collection of ids (a single int, a str, None) or
                holds an item that is not an int; nothing is ordered.
        """
        return self._jobs.fence(_job_ids(job_ids, "nothing was ordered"), stream, self._device)

    def wait(self, job_ids: Iterable[int]) -> list[TransferResult]:
        """Block until the given jobs are finished and return their results.

        Results of these jobs are removed from what :meth:`get_finished` will return; results
        of other jobs stay queued.

        Raises:
            KeyError: for a job id that was never submitted or whose result was already taken
                (checked before waiting: then no result is taken, every job stays reportable).
            ValueError: a job id given more than once (each result is reported once; nothing
                is taken).
            TypeError: ``job_ids`` is not a collection of ids (a single int, a str, None) or
                holds an item that is not an int; nothing is taken.
        """
        return self._jobs.wait(_job_ids(job_ids, "nothing was taken"))
