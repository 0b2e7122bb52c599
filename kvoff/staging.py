"""Staged transfers for layer-major GPU caches (docs/design.md "Moving bytes").

A layer-major GPU cache keeps one tensor per layer, so one GPU block is scattered over as many
small chunks as there are layers (64 chunks of 32 KiB for Llama-3-8B). Copy engines move small
chunks slowly (about 2 µs of setup each), and the SM kernel that moves them fast over PCIe
occupies SMs for the whole transfer (a concurrent GEMM ran 79 % slower on an H100). Staging
splits the work where each part is cheap:

* **store**: one SM gather launch copies all layers of a few blocks into a GPU staging buffer
  laid out like the CPU slot (each block one contiguous sub-block of ``bytes_per_gpu_block``,
  layers at their slot offsets). It reads and writes HBM, so it is over in a short burst. Then
  the copy engines DMA whole sub-blocks (2 MiB for Llama-3-8B; a run of adjacent slots in one
  piece) into the pinned CPU pool.
* **load**: the reverse: DMA of whole sub-blocks into the staging buffer, then one SM scatter
  launch into the layer tensors.

The staging buffer has a fixed size (``staging_bytes``, per direction) and never grows with the
job: it is cut into ``num_slots`` pieces used round robin. A job is cut into pieces of at most
``piece_blocks`` blocks; the SM copy of piece ``i + 1`` overlaps the DMA of piece ``i``. Each
piece slot has two events: ``ready`` (its bytes are staged) and ``free`` (its last reader is
done), so a slot is reused, also by the next job, only after its previous piece has left it.

The same code runs with CPU tensors (CI): a :class:`Lane` is then the calling thread, every
copy finishes before the call returns and events are never needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvoff.ops import copy_blocks_fast
from kvoff.transfer import DEFAULT_STAGING_BYTES, DEFAULT_STAGING_PIECE_BYTES

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "DEFAULT_STAGING_PIECE_BYTES",
    "Lane",
    "StagingRing",
    "staged_load",
    "staged_store",
]


class Lane:
    """One ordered queue of transfer work: a CUDA stream, or on the CPU the calling thread.

    On CUDA every method enqueues; on the CPU work runs at once and in order, so waiting and
    recording are no-ops (every earlier operation has already finished).

    Args:
        device: the device of the GPU side (``cpu`` for CPU mode).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device) if device.type == "cuda" else None
        )

    def context(self) -> contextlib.AbstractContextManager[object]:
        """A context in which torch (and ``kvoff.copy_blocks``) enqueues on this lane."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def wait_event(self, event: torch.cuda.Event | None) -> None:
        """Later work on this lane waits for ``event`` (a never-recorded event is no wait)."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def wait_stream(self, stream: torch.cuda.Stream | None) -> None:
        """Later work on this lane waits for everything enqueued on ``stream`` so far."""
        if self.stream is not None and stream is not None:
            self.stream.wait_stream(stream)

    def record(self, event: torch.cuda.Event | None) -> None:
        """Record ``event`` at this point of the lane (no-op on the CPU)."""
        if self.stream is not None and event is not None:
            event.record(self.stream)


@dataclass(frozen=True)
class StagedGroup:
    """What a staged copy needs to know of one KV cache group.

    Attributes:
        gpu_rows: per copied row region, the ``(num_gpu_blocks, row_bytes)`` uint8 GPU view.
        offsets: per region, its byte offset inside a sub-block (the slot layout).
        cpu_runs: ``(offset, length)`` of the contiguous byte ranges of a sub-block that the
            group uses (the regions' slot ranges, merged), in ascending order.
        cpu_run_rows: per run, the ``(num_cpu_blocks × block_size_factor, length)`` uint8 view
            of the CPU pool (row stride: the sub-block).
    """

    gpu_rows: list[torch.Tensor]
    offsets: list[int]
    cpu_runs: list[tuple[int, int]]
    cpu_run_rows: list[torch.Tensor]


class StagingRing:
    """A fixed staging buffer on ``device`` cut into pieces used round robin.

    Args:
        device: where the buffer lives (the GPU side's device).
        total_bytes: bytes of the buffer (at least one sub-block).
        sub_block_bytes: bytes of one staged block (``bytes_per_gpu_block`` of the worker).
        piece_bytes: bytes of one piece, rounded down to whole sub-blocks (at least one).

    Attributes:
        piece_blocks: blocks per piece.
        num_slots: pieces the buffer holds.
        buffer: the ``(num_slots × piece_blocks × sub_block_bytes,)`` uint8 tensor.

    Raises:
        ValueError: when ``total_bytes`` is smaller than one sub-block, or a size is not
            positive.
    """

    def __init__(
        self, device: torch.device, total_bytes: int, sub_block_bytes: int, piece_bytes: int
    ) -> None:
        if sub_block_bytes < 1 or piece_bytes < 1:
            raise ValueError(
                f"sub_block_bytes ({sub_block_bytes}) and piece_bytes ({piece_bytes}) must be >= 1"
            )
        if total_bytes < sub_block_bytes:
            raise ValueError(
                f"staging_bytes per direction = {total_bytes} is smaller than one GPU block of "
                f"all layers ({sub_block_bytes} bytes); raise staging_bytes to at least "
                f"{2 * sub_block_bytes} (both directions), or set it to 0 to disable staging"
            )
        self.sub_block_bytes = sub_block_bytes
        self.piece_blocks = max(1, min(piece_bytes, total_bytes) // sub_block_bytes)
        self.num_slots = total_bytes // (self.piece_blocks * sub_block_bytes)
        self.buffer = torch.empty(
            self.num_slots * self.piece_blocks * sub_block_bytes, dtype=torch.uint8, device=device
        )
        cuda = device.type == "cuda"
        self.ready = [torch.cuda.Event() if cuda else None for _ in range(self.num_slots)]
        self.free = [torch.cuda.Event() if cuda else None for _ in range(self.num_slots)]
        self._next = 0
        # per (group, slot): the slot's views of the group's regions and of its slot runs, made
        # once (slicing dozens of views per piece would cost as much host time as the copy)
        self._views: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    @property
    def num_bytes(self) -> int:
        """Bytes of the buffer."""
        return self.buffer.numel()

    def acquire(self) -> int:
        """The next slot, round robin (its user waits on ``free[slot]`` before writing)."""
        slot = self._next
        self._next = (slot + 1) % self.num_slots
        return slot

    def group_views(
        self, slot: int, group: StagedGroup
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``slot``'s full-piece views ``(piece_blocks, bytes)`` of ``group``'s copy regions
        and of its slot runs, at their slot offsets (cached; a piece of fewer blocks uses the
        first rows)."""
        key = (id(group), slot)
        views = self._views.get(key)
        if views is None:
            stage = self.view(slot, self.piece_blocks)
            regions = [stage[:, o : o + r.shape[1]] for o, r in zip(group.offsets, group.gpu_rows,
                                                                  strict=True)]  # fmt: skip
            runs = [stage[:, o : o + n] for o, n in group.cpu_runs]
            views = self._views[key] = (regions, runs)
        return views

    def view(self, slot: int, blocks: int) -> torch.Tensor:
        """The first ``blocks`` sub-blocks of ``slot`` as a ``(blocks, sub_block_bytes)`` view."""
        size = self.piece_blocks * self.sub_block_bytes
        start = slot * size
        return self.buffer[start : start + blocks * self.sub_block_bytes].view(
            blocks, self.sub_block_bytes
        )


_LOCAL = np.arange(4096, dtype=np.int64)  # staging rows 0..m-1 of a piece (read-only use)


def _pieces(n: int, piece: int) -> Iterator[tuple[int, int]]:
    for a in range(0, n, piece):
        yield a, min(n, a + piece)


def staged_store(
    group: StagedGroup,
    gpu_ids: np.ndarray,
    cpu_rows: np.ndarray,
    ring: StagingRing,
    sm: Lane,
    dma: Lane,
    *,
    sm_mechanism: str,
    dma_mechanism: str,
) -> None:
    """Enqueue a staged store of ``gpu_ids`` (GPU block ids) into CPU pool rows ``cpu_rows``
    (sub-block rows: CPU block id × block_size_factor + offset); both ``(n,)`` int64
    arrays, already validated. The gather runs on ``sm``, the DMA on ``dma``; both lanes must
    already wait for whatever wrote the GPU blocks. Returns once everything is enqueued (on the
    CPU: done).

    Raises:
        RuntimeError, ValueError, IndexError: from ``torch.ops.kvoff.copy_blocks`` (nothing
            of a piece that raised was enqueued; earlier pieces were).
    """
    n = len(gpu_ids)
    for a, b in _pieces(n, ring.piece_blocks):
        slot = ring.acquire()
        regions, runs = ring.group_views(slot, group)
        local = _LOCAL[: b - a] if b - a <= len(_LOCAL) else np.arange(b - a, dtype=np.int64)
        with sm.context():
            sm.wait_event(ring.free[slot])
            copy_blocks_fast(group.gpu_rows, regions, gpu_ids[a:b], local, sm_mechanism)
            sm.record(ring.ready[slot])
        with dma.context():
            dma.wait_event(ring.ready[slot])
            copy_blocks_fast(runs, group.cpu_run_rows, local, cpu_rows[a:b], dma_mechanism)
            dma.record(ring.free[slot])


def staged_load(
    group: StagedGroup,
    cpu_rows: np.ndarray,
    gpu_ids: np.ndarray,
    ring: StagingRing,
    sm: Lane,
    dma: Lane,
    *,
    sm_mechanism: str,
    dma_mechanism: str,
) -> None:
    """Enqueue a staged load of CPU pool rows ``cpu_rows`` into GPU blocks ``gpu_ids`` (both
    ``(n,)`` int64 arrays, already validated): DMA on ``dma``, scatter on ``sm``. The
    loaded blocks are complete once ``sm`` reaches the point after this call.

    Raises:
        RuntimeError, ValueError, IndexError: from ``torch.ops.kvoff.copy_blocks``.
    """
    n = len(gpu_ids)
    for a, b in _pieces(n, ring.piece_blocks):
        slot = ring.acquire()
        regions, runs = ring.group_views(slot, group)
        local = _LOCAL[: b - a] if b - a <= len(_LOCAL) else np.arange(b - a, dtype=np.int64)
        with dma.context():
            dma.wait_event(ring.free[slot])
            copy_blocks_fast(group.cpu_run_rows, runs, cpu_rows[a:b], local, dma_mechanism)
            dma.record(ring.ready[slot])
        with sm.context():
            sm.wait_event(ring.ready[slot])
            copy_blocks_fast(regions, group.gpu_rows, local, gpu_ids[a:b], sm_mechanism)
            sm.record(ring.free[slot])
