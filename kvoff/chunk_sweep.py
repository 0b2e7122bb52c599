"""Measuring what ``mechanism="auto"`` decides from: the chunk sweep and the thresholds made of it.

The sweep times single-tensor jobs of scattered chunks through ``kvoff.ops.copy_blocks``, per
chunk size, direction and mechanism (``memcpy``, ``batch``, ``kernel``); :func:`derive_thresholds`
turns its rows and the measured compute costs into :class:`kvoff.transfer.TransferThresholds`.
``kvoff bench transfer --sweep`` runs the full sweep (4 KiB to 2 MiB, 256 MiB per job) and the
first-use calibration (:mod:`kvoff.calibration`) a short one under a deadline: both call
:func:`measure_chunk_sweep`, so the library never imports ``kvoff.tools``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvoff.ops import copy_blocks
from kvoff.transfer import (
    COPY_MECHANISMS,
    MEASURED_MECHANISMS,
    DirectionThresholds,
    TransferThresholds,
)

__all__ = ["SweepTimeout", "derive_thresholds", "measure_chunk_sweep"]


class SweepTimeout(TimeoutError):
    """The sweep reached its deadline before every measurement was taken."""


def _median_stream_seconds(
    fn: Callable[[], None],
    stream: torch.cuda.Stream | None,
    repeat: int,
    warmup: int,
    deadline: float | None,
) -> float:
    """Median wall time of ``fn`` (which returns once its work is done). Only ``stream`` is
    synchronised, never the device: in a background calibration the engine's own work goes on.

    Raises:
        SweepTimeout: when ``deadline`` (a ``time.monotonic()`` value) passes before a run.
    """
    samples = []
    for i in range(warmup + repeat):
        if deadline is not None and time.monotonic() > deadline:
            raise SweepTimeout("the chunk sweep ran past its deadline")
        if stream is not None:
            stream.synchronize()
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure_chunk_sweep(
    device: torch.device,
    chunk_sizes: Sequence[int],
    *,
    total_bytes: int = 256 << 20,
    repeat: int = 5,
    warmup: int = 1,
    seed: int = 0,
    kernel_blocks: int = 0,
    mechanisms: Sequence[str] = MEASURED_MECHANISMS,
    deadline: float | None = None,
) -> list[dict[str, Any]]:
    """Time scattered single-tensor jobs per chunk size, direction and mechanism.

    Each chunk size ``c`` copies ``n = max(8, total_bytes // c)`` chunks between a ``(2n, c)``
    uint8 tensor on ``device`` and a ``(2n, c)`` host tensor (pinned on CUDA) at random distinct
    rows, on a stream of its own (``kernel`` uses the op's ``kernel_blocks``); the tensors are
    freed before the next size.

    Args:
        device: the GPU side (``cuda``; a CPU device runs the CPU op, for tests).
        chunk_sizes: bytes per chunk, each >= 1.
        total_bytes: bytes per job (about; at least 8 chunks).
        repeat: timed jobs per measurement (the median is kept), >= 1.
        warmup: untimed jobs before them.
        seed: seed of the row choice.
        kernel_blocks: thread blocks of the ``kernel`` mechanism (0: the op's default).
        mechanisms: names passed to ``copy_blocks`` (default ``memcpy``, ``batch``, ``kernel``).
        deadline: a ``time.monotonic()`` value after which no further job starts.

    Returns:
        One row per chunk size, in the given order: ``chunk_bytes``, ``num_chunks`` and
        ``{direction}_{mechanism}_gbps`` (10^9 bytes per second, ``direction`` ``store``: device
        to host, ``load``: host to device).

    Raises:
        SweepTimeout: when ``deadline`` passes (the rows measured so far are discarded).
        ValueError: for a chunk size < 1 or ``repeat`` < 1.
        torch.OutOfMemoryError: when the device cannot hold one size's tensors.
    """
    if repeat < 1 or any(c < 1 for c in chunk_sizes):
        raise ValueError(f"repeat={repeat} and chunk_sizes={list(chunk_sizes)} must be >= 1")
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    rows: list[dict[str, Any]] = []
    for chunk in chunk_sizes:
        n = max(8, total_bytes // chunk)
        gen = torch.Generator().manual_seed(seed)
        # the bytes do not change a copy's speed: filled on the device, no host-side pass
        g = torch.full((2 * n, chunk), 7, dtype=torch.uint8, device=device)
        c = torch.zeros((2 * n, chunk), dtype=torch.uint8, pin_memory=cuda)
        gi = torch.randperm(2 * n, generator=gen)[:n]
        ci = torch.randperm(2 * n, generator=gen)[:n]
        entry: dict[str, Any] = {"chunk_bytes": chunk, "num_chunks": n}
        for direction in ("store", "load"):
            for m in mechanisms:
                args = ([g], [c], gi, ci) if direction == "store" else ([c], [g], ci, gi)

                def run(args: tuple = args, m: str = m) -> None:
                    if stream is None:
                        copy_blocks(*args, mechanism=m, kernel_blocks=kernel_blocks)
                        return
                    with torch.cuda.stream(stream):
                        copy_blocks(*args, mechanism=m, kernel_blocks=kernel_blocks)
                    stream.synchronize()

                seconds = _median_stream_seconds(run, stream, repeat, warmup, deadline)
                entry[f"{direction}_{m}_gbps"] = (
                    n * chunk / seconds / 1e9 if seconds > 0 else float("inf")
                )
        rows.append(entry)
        del g, c  # one size's tensors at a time: the engine holds most of the GPU's memory
    return rows


def derive_thresholds(
    sweep: Sequence[dict[str, Any]],
    slowdowns: dict[str, dict[str, float]],
    staged_efficiency: dict[str, float],
    source: str,
) -> TransferThresholds:
    """Thresholds from a chunk sweep and the measured costs.

    Args:
        sweep: rows of ``chunk_bytes`` and ``{direction}_{mechanism}_gbps`` (mechanism in
            ``memcpy``, ``batch``, ``kernel``), any order.
        slowdowns: per direction, per mechanism (``memcpy``, ``batch``, ``kernel``, ``staged``)
            the measured ``gemm_slowdown``.
        staged_efficiency: per direction, staged GB/s over the copy-engine GB/s of whole
            sub-blocks (clamped into ``(0, 1]``).
        source: where the numbers come from.

    Raises:
        ValueError: for an empty sweep, or missing mechanisms or directions.
    """
    if not sweep:
        raise ValueError("the sweep is empty: run kvoff bench transfer --sweep on a GPU")
    rows = sorted(sweep, key=lambda r: r["chunk_bytes"])
    per: dict[str, DirectionThresholds] = {}
    for d in ("store", "load"):
        missing = [m for m in COPY_MECHANISMS if m not in slowdowns.get(d, {})]
        if missing or d not in staged_efficiency:
            raise ValueError(
                f"{d}: slowdowns of {missing} or the staged efficiency are missing; measure "
                "every mechanism (run the presets with --gemm)"
            )
        per[d] = DirectionThresholds(
            chunk_bytes=tuple(int(r["chunk_bytes"]) for r in rows),
            gbps={m: tuple(float(r[f"{d}_{m}_gbps"]) for r in rows) for m in MEASURED_MECHANISMS},
            gemm_slowdown={m: max(0.0, float(slowdowns[d][m])) for m in COPY_MECHANISMS},
            staged_efficiency=min(1.0, max(1e-3, float(staged_efficiency[d]))),
        )
    return TransferThresholds(store=per["store"], load=per["load"], source=source)
