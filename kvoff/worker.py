"""The worker: owns the CPU pool tensors and moves blocks between them and the GPU KV cache.

One worker runs per tensor-parallel rank. It registers the engine's KV cache tensors as block
rows, allocates the CPU pool (pinned when CUDA is available), and runs load (CPU→GPU) and store
(GPU→CPU) jobs through ``torch.ops.kvoff.copy_blocks``.

Row layout (DESIGN.md "Moving bytes"): each registered GPU tensor is viewed as
``(num_gpu_blocks, page_bytes)`` uint8 rows, using the engine's ``num_gpu_blocks`` (never the
tensor's leading dimension: DESIGN.md invariant 2). Its CPU twin is a
``(num_cpu_blocks, page_bytes × block_size_factor)`` uint8 tensor, copied as
``(num_cpu_blocks × block_size_factor, page_bytes)`` rows, so GPU block ``i`` of offloaded
block ``j`` lands in CPU row ``cpu_block_id × block_size_factor + (i % block_size_factor)``.

On CPU builds jobs run synchronously inside :meth:`OffloadingWorker.transfer_async`; on CUDA each
direction has its own stream (FIFO within a direction), every job records an event, and
:meth:`OffloadingWorker.get_finished` polls events without blocking. Each CUDA job picks its copy
mechanism (copy calls, one batched copy call, or the SM kernel) from its chunk size, chunk count
and direction (:func:`kvoff.transfer.choose_mechanism`), unless one is forced.

The CPU pool is one exact-size host allocation (no power-of-two rounding), page-locked in chunks
when pinned (:class:`kvoff.pinned.HostPool`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from kvoff.ops import MECHANISMS, batch_copy_supported, copy_blocks
from kvoff.pinned import DEFAULT_PIN_CHUNK_BYTES, HostPool
from kvoff.registration import KVLayout, block_row_views
from kvoff.transfer import TransferThresholds, choose_mechanism, default_thresholds

if TYPE_CHECKING:
    from kvoff.config import OffloadingConfig
    from kvoff.offloading_spec import CPUOffloadingSpec
    from kvoff.specs import KVCacheConfig

__all__ = ["CPUBlockSpec", "GPUBlockSpec", "OffloadingWorker", "TransferResult"]

Direction = Literal["store", "load"]


def _int_tuple(name: str, values: Iterable[int]) -> tuple[int, ...]:
    out = tuple(int(v) for v in values)
    if any(v < 0 for v in out):
        raise ValueError(f"{name} must be non-negative, got {list(out)}")
    return out


@dataclass(frozen=True)
class GPUBlockSpec:
    """The GPU side of a job.

    Attributes:
        block_ids: GPU block ids of all KV cache groups, concatenated in group order.
        group_sizes: how many of ``block_ids`` belong to each group (one entry per group,
            0 allowed); ``sum(group_sizes) == len(block_ids)`` (DESIGN.md invariant 1).
        block_indices: per group, the logical index (position in the request, in GPU blocks)
            of the group's first block; ``block_indices[g] % block_size_factor`` is the offset
            of that block inside its offloaded block (a partial first offloaded block).

    Raises:
        ValueError: when the sizes disagree or a value is negative.
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

    @classmethod
    def single_group(cls, block_ids: Sequence[int], block_index: int = 0) -> GPUBlockSpec:
        """A spec for a model with one KV cache group starting at logical ``block_index``."""
        return cls(tuple(block_ids), (len(block_ids),), (block_index,))


@dataclass(frozen=True)
class CPUBlockSpec:
    """The CPU side of a job: CPU block ids (slots), for all groups in group order.

    For group ``g`` with ``n`` GPU blocks starting at logical index ``s``, the job uses
    ``(s + n - 1) // block_size_factor - s // block_size_factor + 1`` CPU blocks (0 if n == 0).
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
        mechanism: how the bytes moved: ``"memcpy"``, ``"batch"``, ``"kernel"`` or
            ``"per_block"`` on CUDA (``"batch"`` may have fallen back to copy calls where
            ``cudaMemcpyBatchAsync`` is unsupported), ``"cpu"`` for CPU-only copies.
    """

    job_id: int
    direction: Direction
    success: bool
    num_bytes: int
    seconds: float
    error: str | None = None
    mechanism: str = "cpu"


@dataclass
class _Group:
    gpu_rows: list[torch.Tensor] = field(default_factory=list)
    cpu_rows: list[torch.Tensor] = field(default_factory=list)
    row_bytes: int = 0  # sum of the page bytes of its tensors (bytes per GPU block)


@dataclass
class _InFlight:
    job_id: int
    direction: Direction
    num_bytes: int
    mechanism: str
    start: torch.cuda.Event
    end: torch.cuda.Event


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
        pin_chunk_bytes: largest piece of the pool page-locked by one ``cudaHostRegister``
            call (default 1 GiB).
        mechanism: how CUDA jobs copy: ``"auto"`` (per job, from the thresholds) or one of
            ``"memcpy"``, ``"batch"``, ``"kernel"``, ``"per_block"`` for every job
            (``kvoff.ops.MECHANISMS``). CPU-only copies ignore it.
        thresholds: what ``"auto"`` decides from (default: :func:`kvoff.transfer.load_thresholds`:
            ``$KVOFF_TRANSFER_THRESHOLDS`` or the packaged defaults).

    Raises:
        ValueError: on non-positive sizes or an unknown mechanism.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size_factor: int = 1,
        *,
        kv_cache_config: KVCacheConfig | None = None,
        pin_memory: bool | None = None,
        pin_chunk_bytes: int = DEFAULT_PIN_CHUNK_BYTES,
        mechanism: str = "auto",
        thresholds: TransferThresholds | None = None,
    ) -> None:
        if mechanism not in MECHANISMS:
            raise ValueError(
                f"mechanism={mechanism!r} is not one of {list(MECHANISMS)}; use 'auto' to let "
                "each job choose"
            )
        if pin_chunk_bytes < 1:
            raise ValueError(f"pin_chunk_bytes must be >= 1, got {pin_chunk_bytes}")
        for name, value in (
            ("num_gpu_blocks", num_gpu_blocks),
            ("num_cpu_blocks", num_cpu_blocks),
            ("block_size_factor", block_size_factor),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size_factor = block_size_factor
        if kv_cache_config is not None and kv_cache_config.num_blocks != num_gpu_blocks:
            raise ValueError(
                f"num_gpu_blocks={num_gpu_blocks} differs from kv_cache_config.num_blocks="
                f"{kv_cache_config.num_blocks}; the config's count is authoritative"
            )
        self.kv_cache_config = kv_cache_config
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.pin_chunk_bytes = pin_chunk_bytes
        self.mechanism = mechanism
        self.thresholds = thresholds
        self._pool: HostPool | None = None
        self._batch_supported: bool | None = None
        self._groups: list[_Group] = []
        self._layer_names: list[str] = []
        self._cpu_tensors: list[torch.Tensor] = []
        self._canonical_row_bytes: list[int] = []
        self._device: torch.device | None = None
        self._finished: list[TransferResult] = []
        self._in_flight: dict[int, _InFlight] = {}
        self._streams: dict[Direction, torch.cuda.Stream] = {}

    @classmethod
    def from_spec(
        cls,
        spec: CPUOffloadingSpec,
        *,
        pin_memory: bool | None = None,
        config: OffloadingConfig | None = None,
    ) -> OffloadingWorker:
        """A worker for one rank of the plan ``spec`` (a :class:`kvoff.CPUOffloadingSpec`): GPU
        blocks from its ``KVCacheConfig.num_blocks``, CPU slots and block_size_factor from the
        same spec the scheduler uses, so every rank's pool matches the scheduler's count.
        ``config`` (an :class:`kvoff.OffloadingConfig`) supplies the pinning and transfer options
        (:meth:`~kvoff.OffloadingConfig.worker_options`); an explicit ``pin_memory`` wins.

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
        """Register the engine's KV cache tensors and allocate the CPU pool.

        Each layer's tensor becomes one or more ``(num_gpu_blocks, row_bytes)`` block-row views
        (see :func:`kvoff.registration.block_row_views` for the layouts: blocks first, K/V
        first, kernel blocks, tensors shared across groups, padded Mamba pages), always using
        ``num_gpu_blocks`` (``KVCacheConfig.num_blocks``), never the tensor's leading dimension
        (DESIGN.md invariant 2). Every view gets a CPU twin of
        ``(num_cpu_blocks, row_bytes × block_size_factor)`` bytes.

        Args:
            kv_caches: layer name → that layer's KV cache tensor (any dtype; bytes are copied as
                they are), or for a Mamba layer a list of its state tensors.
            layer_to_group: layer name → KV cache group index (default: from the worker's
                ``kv_cache_config``, else all layers in group 0). Groups are numbered 0..G-1.
            kv_layout: ``"auto"``, ``"blocks_first"`` or ``"kv_first"`` for attention tensors.

        Raises:
            ValueError: when already registered, when ``kv_caches`` is empty or does not name
                exactly the config's layers, when tensors are on different devices, when a
                tensor's bytes do not fit ``num_gpu_blocks`` blocks of its spec's page, or when
                groups have gaps.
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
        # by several layers of one group) form ONE canonical tensor with ONE CPU twin: a CPU
        # slot holds one offloaded block of one group, so a slot's bytes are the bytes one GPU
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
        f = self.block_size_factor
        pool = HostPool(
            [(self.num_cpu_blocks, row * f) for row in canon_rows],
            pin=self.pin_memory,
            chunk_bytes=self.pin_chunk_bytes,
            description=(
                f"the CPU pool ({self.num_cpu_blocks} CPU blocks of "
                f"{sum(canon_rows) * f} bytes over {len(canon_rows)} tensors)"
            ),
        )
        cpu_tensors = pool.tensors
        groups = [_Group() for _ in range(num_groups)]
        for g, views in enumerate(per_group):
            for c, rows in views:
                row = rows.shape[1]
                cpu = cpu_tensors[c].as_strided((self.num_cpu_blocks * f, row), (canon_rows[c], 1))
                groups[g].gpu_rows.append(rows)
                groups[g].cpu_rows.append(cpu)
                groups[g].row_bytes += row
        self._pool = pool
        self._cpu_tensors = cpu_tensors
        self._canonical_row_bytes = canon_rows
        self._groups = groups
        self._layer_names = list(kv_caches)
        self._device = next(iter(devices))
        if self._device.type == "cuda":
            self._streams = {
                "store": torch.cuda.Stream(self._device),
                "load": torch.cuda.Stream(self._device),
            }

    # ------------------------------------------------------------------ properties
    @property
    def num_groups(self) -> int:
        """KV cache groups registered."""
        return len(self._groups)

    @property
    def bytes_per_gpu_block(self) -> int:
        """Bytes one GPU block id costs over the registered tensors of this rank (each
        canonical tensor counted once, however many layers or groups share it; Mamba padding
        not counted). Equals ``CPUOffloadingSpec.kv_bytes_per_block`` without padding."""
        return sum(self._canonical_row_bytes)

    @property
    def cpu_pool_bytes(self) -> int:
        """Bytes of block data in the CPU pool of this rank: ``bytes_per_gpu_block ×
        block_size_factor × num_cpu_blocks``."""
        return self.bytes_per_gpu_block * self.block_size_factor * self.num_cpu_blocks

    @property
    def cpu_pool_allocated_bytes(self) -> int:
        """Bytes actually allocated (and pinned, when pinned) for the CPU pool: the block data
        plus less than 4 KiB of alignment per tensor; 0 before registration."""
        return 0 if self._pool is None else self._pool.num_bytes

    @property
    def cpu_pool_pinned(self) -> bool:
        """Whether the CPU pool is page-locked."""
        return self._pool is not None and self._pool.pinned

    def close(self) -> None:
        """Release the pinned registration of the CPU pool (after waiting for jobs in flight).
        Idempotent. The worker must not run jobs afterwards."""
        if self._in_flight:
            self.wait(list(self._in_flight))
        if self._pool is not None:
            self._pool.close()

    def cpu_tensors(self) -> list[torch.Tensor]:
        """The CPU pool as ``(num_cpu_blocks × block_size_factor, row_bytes)`` uint8 row views,
        one per block-row view of :meth:`gpu_tensors`, in the same order."""
        return [t for g in self._groups for t in g.cpu_rows]

    def gpu_tensors(self) -> list[torch.Tensor]:
        """The registered KV caches as ``(num_gpu_blocks, row_bytes)`` uint8 block-row views, in
        group order (a tensor shared by several groups appears once per group)."""
        return [t for g in self._groups for t in g.gpu_rows]

    # ------------------------------------------------------------------ jobs
    def _expand(
        self, gpu: GPUBlockSpec, cpu: CPUBlockSpec
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per group: (GPU row ids, CPU row ids) as int64 tensors."""
        if len(gpu.group_sizes) != len(self._groups):
            raise ValueError(
                f"the job has {len(gpu.group_sizes)} group_sizes entries but "
                f"{len(self._groups)} KV cache groups are registered; give one per group"
            )
        f = self.block_size_factor
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        gpu_off = 0
        cpu_off = 0
        cpu_ids = torch.tensor(cpu.block_ids, dtype=torch.int64)
        for n, start in zip(gpu.group_sizes, gpu.block_indices, strict=True):
            if n == 0:
                out.append((torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)))
                continue
            first = start // f
            count = (start + n - 1) // f - first + 1
            if cpu_off + count > len(cpu_ids):
                raise ValueError(
                    f"the CPU side has {len(cpu_ids)} block ids, but the GPU side needs at least "
                    f"{cpu_off + count} (group sizes {list(gpu.group_sizes)}, block indices "
                    f"{list(gpu.block_indices)}, block_size_factor {f})"
                )
            logical = torch.arange(start, start + n, dtype=torch.int64)
            slots = cpu_ids[cpu_off + logical // f - first]
            out.append(
                (
                    torch.tensor(gpu.block_ids[gpu_off : gpu_off + n], dtype=torch.int64),
                    slots * f + logical % f,
                )
            )
            gpu_off += n
            cpu_off += count
        if cpu_off != len(cpu_ids):
            raise ValueError(
                f"the CPU side has {len(cpu_ids)} block ids but the GPU side covers {cpu_off} "
                f"offloaded blocks (group sizes {list(gpu.group_sizes)}, block indices "
                f"{list(gpu.block_indices)}, block_size_factor {f})"
            )
        return out

    def transfer_async(
        self, job_id: int, src: GPUBlockSpec | CPUBlockSpec, dst: GPUBlockSpec | CPUBlockSpec
    ) -> bool:
        """Submit one job: a store (``GPUBlockSpec`` → ``CPUBlockSpec``) or a load (the reverse).

        On CPU the copy runs before this returns; its result is queued for
        :meth:`get_finished`. On CUDA the copy is queued on the direction's stream (a store
        first waits on the current compute stream so it sees the forward pass's writes).

        Returns:
            True when the job was submitted (CUDA) or ran successfully (CPU); False when the
            copy failed (for example an out-of-range block id): the failure is also reported as
            ``TransferResult(success=False)`` and no other job's blocks are touched.

        Raises:
            ValueError: when nothing is registered, ``job_id`` is already in flight, both sides
                have the same type, or the two sides do not describe the same blocks.
        """
        if not self._groups:
            raise ValueError("no KV caches registered: call register_kv_caches first")
        if job_id in self._in_flight:
            raise ValueError(f"job_id {job_id} is already in flight; use a fresh job id")
        if isinstance(src, GPUBlockSpec) and isinstance(dst, CPUBlockSpec):
            direction: Direction = "store"
            gpu, cpu = src, dst
        elif isinstance(src, CPUBlockSpec) and isinstance(dst, GPUBlockSpec):
            direction = "load"
            gpu, cpu = dst, src
        else:
            raise ValueError(
                f"a job copies GPUBlockSpec→CPUBlockSpec (store) or CPUBlockSpec→GPUBlockSpec "
                f"(load), got {type(src).__name__}→{type(dst).__name__}"
            )
        per_group = self._expand(gpu, cpu)
        num_bytes = sum(
            len(gpu_ids) * g.row_bytes
            for (gpu_ids, _), g in zip(per_group, self._groups, strict=True)
        )
        if self._streams:
            return self._submit_cuda(job_id, direction, per_group, num_bytes)
        t0 = time.perf_counter()
        try:
            self._check_ids(direction, per_group)
            self._copy(direction, per_group)
        except (RuntimeError, ValueError, IndexError) as exc:
            self._finished.append(
                TransferResult(job_id, direction, False, 0, time.perf_counter() - t0, str(exc))
            )
            return False
        self._finished.append(
            TransferResult(job_id, direction, True, num_bytes, time.perf_counter() - t0)
        )
        return True

    def _copy(
        self,
        direction: Direction,
        per_group: list[tuple[torch.Tensor, torch.Tensor]],
        mechanism: str = "auto",
    ) -> None:
        for (gpu_ids, cpu_ids), g in zip(per_group, self._groups, strict=True):
            if len(gpu_ids) == 0:
                continue
            if direction == "store":
                copy_blocks(g.gpu_rows, g.cpu_rows, gpu_ids, cpu_ids, mechanism=mechanism)
            else:
                copy_blocks(g.cpu_rows, g.gpu_rows, cpu_ids, gpu_ids, mechanism=mechanism)

    def _check_ids(
        self, direction: Direction, per_group: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Validate every group's row ids before any copy, so a bad job writes nothing.

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
                ("CPU", cpu_ids, cpu_rows, "CPU rows (CPU block id × block_size_factor + offset)"),
            ):
                bad = (ids < 0) | (ids >= limit)
                if bool(bad.any()):
                    first = int(ids[bad.nonzero()[0, 0]])
                    raise ValueError(
                        f"group {g}: {name} id {first} is out of range; {what} must be in "
                        f"[0, {limit}). The job was not run."
                    )
            dst = cpu_ids if direction == "store" else gpu_ids
            if len(torch.unique(dst)) != len(dst):
                raise ValueError(
                    f"group {g}: a destination id repeats in {dst.tolist()}; two writes to one "
                    "block would race. The job was not run."
                )

    def job_chunks(self, per_group: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int]:
        """``(num_chunks, num_bytes)`` of a job: a chunk is one run of blocks whose GPU and CPU
        row ids both go up by one, in one copied tensor (what one copy call moves)."""
        chunks = 0
        num_bytes = 0
        for (gpu_ids, cpu_ids), g in zip(per_group, self._groups, strict=True):
            n = len(gpu_ids)
            if n == 0:
                continue
            breaks = 0
            if n > 1:
                step = (gpu_ids[1:] - gpu_ids[:-1] != 1) | (cpu_ids[1:] - cpu_ids[:-1] != 1)
                breaks = int(step.sum())
            chunks += (breaks + 1) * len(g.gpu_rows)
            num_bytes += n * g.row_bytes
        return chunks, num_bytes

    def _resolve_mechanism(
        self, direction: Direction, per_group: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> str:
        if self.mechanism != "auto":
            return self.mechanism
        if self._batch_supported is None:
            self._batch_supported = batch_copy_supported()
        chunks, num_bytes = self.job_chunks(per_group)
        return choose_mechanism(
            num_bytes / max(chunks, 1),
            chunks,
            direction,
            self.thresholds or default_thresholds(),
            batch_supported=self._batch_supported,
        )

    def _submit_cuda(
        self,
        job_id: int,
        direction: Direction,
        per_group: list[tuple[torch.Tensor, torch.Tensor]],
        num_bytes: int,
    ) -> bool:
        stream = self._streams[direction]
        mechanism = self._resolve_mechanism(direction, per_group)
        if direction == "store":
            stream.wait_stream(torch.cuda.current_stream(self._device))
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            try:
                self._check_ids(direction, per_group)
                self._copy(direction, per_group, mechanism)
            except (RuntimeError, ValueError, IndexError) as exc:
                # _check_ids validated every group before any copy was enqueued, so a failed
                # job wrote nothing; its start event is simply never used.
                self._finished.append(
                    TransferResult(job_id, direction, False, 0, 0.0, str(exc), mechanism)
                )
                return False
            end.record(stream)
        self._in_flight[job_id] = _InFlight(job_id, direction, num_bytes, mechanism, start, end)
        return True

    def _complete(self, job: _InFlight) -> TransferResult:
        del self._in_flight[job.job_id]
        seconds = job.start.elapsed_time(job.end) / 1e3
        return TransferResult(
            job.job_id, job.direction, True, job.num_bytes, seconds, None, job.mechanism
        )

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
            KeyError: for a job id that was never submitted or whose result was already taken.
        """
        wanted = list(job_ids)
        results: dict[int, TransferResult] = {}
        for jid in wanted:
            job = self._in_flight.get(jid)
            if job is not None:
                job.end.synchronize()
                results[jid] = self._complete(job)
        keep = []
        for r in self._finished:
            if r.job_id in wanted and r.job_id not in results:
                results[r.job_id] = r
            else:
                keep.append(r)
        self._finished = keep
        missing = [j for j in wanted if j not in results]
        if missing:
            raise KeyError(
                f"unknown job ids {missing}: never submitted, or their results were already taken"
            )
        return [results[j] for j in wanted]
