"""Choosing how a transfer job moves its bytes: the fastest way whose cost to the forward pass
stays within a budget (docs/design.md "Moving bytes").

An engine offloads to save GPU time, so a copy is judged by two numbers: its bandwidth, and how
much it slows the compute that runs beside it (``gemm_slowdown``: the time of a bf16 GEMM while
the transfer streams, over its time alone, minus one). On an H100 the SM gather/scatter kernel
moves 32 KiB chunks at 0.92 of the PCIe ceiling but slows a concurrent GEMM by 79 %; copy
engines slow it by about 1 % (``bench/results/gpu/h100-2026-11-23``).

The ways a job of one KV cache group can move (the worker's ``mechanism``):

* ``"memcpy"``: one copy-engine call per chunk (a run of adjacent blocks of one copied row
  region). About 2 µs of setup per call: 32 KiB chunks reach 11 GB/s.
* ``"batch"``: the same chunks in one ``cudaMemcpyBatchAsync`` call (CUDA ≥ 12.8): 33 GB/s at
  32 KiB, the ceiling from about 256 KiB.
* ``"kernel"``: one SM gather/scatter launch reading or writing pinned host memory: near the
  ceiling at any chunk size, at a large compute slowdown.
* ``"staged"``: for layer-major GPU caches (one tensor per layer): an SM gather of all layers of
  a few blocks into a GPU staging buffer laid out like the CPU slot (HBM to HBM, a short burst),
  then copy-engine DMA of whole sub-blocks (2 MiB for Llama-3-8B); loads in reverse. Pipelined
  in bounded pieces.

:class:`TransferThresholds` holds what :func:`choose_mechanism` decides from, per direction:
measured GB/s of ``memcpy``, ``batch`` and ``kernel`` at chunk sizes from 4 KiB to 2 MiB (the
``kvoff bench transfer --sweep`` chunk sweep), the measured ``gemm_slowdown`` of each mechanism,
and ``staged_efficiency`` (staged GB/s over copy-engine GB/s of its DMA chunks). The packaged
file ``kvoff/data/transfer_thresholds.json`` is the H100 measurement of 2026-11-23 (its
``source`` says which numbers came from where); ``kvoff bench transfer --sweep
--write-thresholds FILE`` measures the device at hand. Override with
``$KVOFF_TRANSFER_THRESHOLDS`` (a path), the ``transfer_thresholds`` option, or the worker's
``thresholds=``. Without an override the worker calibrates ``auto`` on the GPU it runs on at
first use and caches the result per GPU and layout (:mod:`kvoff.calibration`); the packaged
file is then only the fallback.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
from dataclasses import dataclass as plain_dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import pydantic
from pydantic.dataclasses import dataclass

__all__ = [
    "ALL_MECHANISMS",
    "COPY_MECHANISMS",
    "DEFAULT_COMPUTE_SLOWDOWN_BUDGET",
    "DEFAULT_STAGING_BYTES",
    "DEFAULT_STAGING_PIECE_BYTES",
    "OP_MECHANISMS",
    "DirectionThresholds",
    "TransferChoice",
    "TransferThresholds",
    "choose_mechanism",
    "default_thresholds",
    "load_thresholds",
    "thresholds_from_json",
]

Direction = Literal["store", "load"]
"""``"store"``: GPU → CPU (device to host); ``"load"``: CPU → GPU (host to device)."""

OP_MECHANISMS: tuple[str, ...] = ("auto", "memcpy", "batch", "kernel", "per_block")
"""Every name ``kvoff.ops.copy_blocks`` accepts (``kvoff.ops.MECHANISMS`` is this tuple)."""

ALL_MECHANISMS: tuple[str, ...] = (*OP_MECHANISMS, "staged")
"""Every name the worker's ``mechanism`` (and the ``transfer_mechanism`` option) accepts: the
op's, plus ``"staged"`` (gather into a GPU staging buffer, then copy-engine DMA)."""

COPY_MECHANISMS: tuple[str, ...] = ("memcpy", "batch", "kernel", "staged")
"""The mechanisms :func:`choose_mechanism` chooses among."""

MEASURED_MECHANISMS: tuple[str, ...] = ("memcpy", "batch", "kernel")
"""Mechanisms whose GB/s the chunk sweep measures per chunk size."""

DEFAULT_COMPUTE_SLOWDOWN_BUDGET = 0.03
"""Default ``compute_slowdown_budget``: the largest ``gemm_slowdown`` ``"auto"`` accepts (3 %)."""

DEFAULT_STAGING_BYTES = 64 << 20
"""Default ``staging_bytes``: the staging buffer of the worker, both directions together
(:mod:`kvoff.staging`)."""

DEFAULT_STAGING_PIECE_BYTES = 8 << 20
"""Default bytes of one piece of a staged job (rounded down to whole sub-blocks, at least one).
Smaller pieces start the first DMA sooner; larger ones mean fewer launches. Chosen, not yet
measured: ``kvoff bench transfer --staging-piece-mib`` compares sizes on a GPU."""

THRESHOLDS_ENV = "KVOFF_TRANSFER_THRESHOLDS"
"""Environment variable naming a thresholds JSON file that replaces the packaged one."""

FORMAT_VERSION = 2
"""Version of the thresholds file format (1: crossover chunk sizes only, no slowdowns)."""

CALIBRATED_FOR = "calibrated_for"
"""Key of a calibration cache file (:mod:`kvoff.calibration`) naming the device, driver and GPU
layout its thresholds were measured for; ignored by :func:`load_thresholds`."""

_CONFIG = pydantic.ConfigDict(extra="forbid")


@dataclass(frozen=True, config=_CONFIG)
class DirectionThresholds:
    """What one direction's mechanisms deliver and cost.

    Attributes:
        chunk_bytes: ascending chunk sizes (bytes of one copied chunk) of the measurements.
        gbps: per mechanism (``memcpy``, ``batch``, ``kernel``), GB/s (10^9 bytes per second)
            at each of ``chunk_bytes``; between two sizes GB/s is interpolated on a log2 scale
            of the size, beyond the ends the nearest value is used.
        gemm_slowdown: per mechanism (``memcpy``, ``batch``, ``kernel``, ``staged``), the
            slowdown of a concurrent bf16 GEMM while the mechanism streams (0.03 = 3 % longer).
        staged_efficiency: GB/s of ``staged`` over the copy-engine GB/s of its DMA chunks
            (the gather or scatter and the pipeline's bubbles), in ``(0, 1]``.
    """

    chunk_bytes: tuple[int, ...]
    gbps: dict[str, tuple[float, ...]]
    gemm_slowdown: dict[str, float]
    staged_efficiency: float = pydantic.Field(gt=0, le=1)

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> DirectionThresholds:
        sizes = list(self.chunk_bytes)
        if not sizes or any(s <= 0 for s in sizes) or sizes != sorted(set(sizes)):
            raise ValueError(
                f"chunk_bytes={sizes} must be positive, strictly ascending sizes (at least one)"
            )
        if set(self.gbps) != set(MEASURED_MECHANISMS):
            raise ValueError(
                f"gbps has curves for {sorted(self.gbps)}; give exactly {list(MEASURED_MECHANISMS)}"
            )
        for name, curve in self.gbps.items():
            if len(curve) != len(sizes) or any(not (v > 0 and math.isfinite(v)) for v in curve):
                raise ValueError(
                    f"gbps[{name!r}] needs {len(sizes)} positive values (one per chunk size), "
                    f"got {list(curve)}"
                )
        if set(self.gemm_slowdown) != set(COPY_MECHANISMS):
            raise ValueError(
                f"gemm_slowdown names {sorted(self.gemm_slowdown)}; give exactly "
                f"{list(COPY_MECHANISMS)}"
            )
        for name, value in self.gemm_slowdown.items():
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"gemm_slowdown[{name!r}]={value} must be a finite value >= 0")
        return self

    def estimate_gbps(self, mechanism: str, chunk_bytes: float) -> float:
        """GB/s of ``mechanism`` (``memcpy``, ``batch`` or ``kernel``) for chunks of
        ``chunk_bytes``, interpolated on a log2 scale of the chunk size.

        Raises:
            ValueError: for an unmeasured mechanism name.
        """
        if mechanism not in self.gbps:
            raise ValueError(f"no GB/s curve for {mechanism!r}; measured: {list(self.gbps)}")
        curve = self.gbps[mechanism]
        sizes = self.chunk_bytes
        if chunk_bytes <= sizes[0]:
            return curve[0]
        if chunk_bytes >= sizes[-1]:
            return curve[-1]
        i = bisect.bisect_right(sizes, chunk_bytes)
        lo, hi = math.log2(sizes[i - 1]), math.log2(sizes[i])
        t = (math.log2(chunk_bytes) - lo) / (hi - lo)
        return curve[i - 1] + t * (curve[i] - curve[i - 1])


@dataclass(frozen=True, config=_CONFIG)
class TransferThresholds:
    """What ``mechanism="auto"`` decides from (see the module docstring).

    Attributes:
        store: GPU → CPU measurements.
        load: CPU → GPU measurements.
        min_chunks_for_kernel: jobs with fewer chunks than this never use the kernel (a few
            copy calls cost less than a launch plus its descriptor upload).
        source: where the numbers come from (device, command, date).
        format: the file format version (:data:`FORMAT_VERSION`).
    """

    store: DirectionThresholds
    load: DirectionThresholds
    min_chunks_for_kernel: int = pydantic.Field(default=4, ge=1)
    source: str = ""
    format: int = FORMAT_VERSION

    @pydantic.field_validator("format")
    @classmethod
    def _known_format(cls, value: int) -> int:
        if value != FORMAT_VERSION:
            raise ValueError(
                f"format={value} is not {FORMAT_VERSION}; measure again with `kvoff bench "
                "transfer --sweep --write-thresholds FILE`"
            )
        return value

    def for_direction(self, direction: Direction) -> DirectionThresholds:
        """The measurements of ``"store"`` or ``"load"``.

        Raises:
            ValueError: for any other direction.
        """
        if direction == "store":
            return self.store
        if direction == "load":
            return self.load
        raise ValueError(f"direction must be 'store' or 'load', got {direction!r}")

    def to_json(self) -> dict[str, object]:
        """The thresholds as the JSON object :func:`load_thresholds` reads."""
        return pydantic.TypeAdapter(TransferThresholds).dump_python(self, mode="json")


def load_thresholds(path: str | os.PathLike[str] | None = None) -> TransferThresholds:
    """Read thresholds from ``path``, else from ``$KVOFF_TRANSFER_THRESHOLDS``, else the
    packaged file (``kvoff/data/transfer_thresholds.json``: the H100 measurement).

    Raises:
        ValueError: when the file is missing, is not UTF-8 JSON, or does not match
            :class:`TransferThresholds` (the message names the file and the bad field; an old
            format-1 file says to measure again).
    """
    if path is None:
        path = os.environ.get(THRESHOLDS_ENV) or None
    if path is None:
        text = resources.files("kvoff").joinpath("data/transfer_thresholds.json").read_text()
        where = "the packaged kvoff/data/transfer_thresholds.json"
    else:
        where = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"transfer thresholds file {where} is not UTF-8 text (byte {exc.start}: "
                f"{exc.reason}); write one with `kvoff bench transfer --sweep "
                f"--write-thresholds {where}`"
            ) from None
        except OSError as exc:
            raise ValueError(
                f"cannot read transfer thresholds from {where}: {exc.strerror}; write one with "
                f"`kvoff bench transfer --sweep --write-thresholds {where}` or unset "
                f"{THRESHOLDS_ENV}"
            ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"transfer thresholds file {where} is not valid JSON: {exc}") from None
    return thresholds_from_json(data, where)


def thresholds_from_json(data: object, where: str) -> TransferThresholds:
    """Validate a parsed thresholds JSON object (a calibration cache file's
    :data:`CALIBRATED_FOR` entry, which names the device it was measured on, is left aside).

    Args:
        data: the parsed JSON document.
        where: the file it came from, for error messages.

    Raises:
        ValueError: when ``data`` does not match :class:`TransferThresholds` (an old format-1
            document says to measure again).
    """
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k != CALIBRATED_FOR}
    if isinstance(data, dict) and "format" not in data:
        raise ValueError(
            f"transfer thresholds file {where} is in the old format (crossover sizes without "
            "compute slowdowns); measure again with `kvoff bench transfer --sweep "
            f"--write-thresholds {where}`"
        )
    try:
        return pydantic.TypeAdapter(TransferThresholds).validate_python(data)
    except pydantic.ValidationError as exc:
        raise ValueError(f"transfer thresholds file {where} is invalid:\n{exc}") from None


@functools.cache
def default_thresholds() -> TransferThresholds:
    """:func:`load_thresholds` with no path, read once per process (clear with
    ``default_thresholds.cache_clear()`` after changing ``$KVOFF_TRANSFER_THRESHOLDS``). On a
    GPU the worker's ``auto`` prefers a calibration of that GPU to the packaged file
    (:func:`kvoff.calibration.worker_thresholds`); this is its fallback."""
    return load_thresholds()


@plain_dataclass(frozen=True)
class TransferChoice:
    """A mechanism and what it is expected to deliver and cost.

    Attributes:
        mechanism: ``"memcpy"``, ``"batch"``, ``"kernel"`` or ``"staged"``.
        gbps: expected GB/s (from the thresholds).
        gemm_slowdown: expected slowdown of concurrent compute.
        within_budget: whether ``gemm_slowdown`` is within the budget (False when no candidate
            was, and the least costly one was taken).
    """

    mechanism: str
    gbps: float
    gemm_slowdown: float
    within_budget: bool


def choose_mechanism(
    chunk_bytes: float,
    num_chunks: int,
    direction: Direction,
    thresholds: TransferThresholds | None = None,
    *,
    batch_supported: bool = True,
    budget: float = DEFAULT_COMPUTE_SLOWDOWN_BUDGET,
    staged_chunk_bytes: float | None = None,
) -> TransferChoice:
    """The fastest mechanism whose compute slowdown is within ``budget``.

    Candidates: ``memcpy``; ``batch`` when ``batch_supported``; ``kernel`` when the job has at
    least ``min_chunks_for_kernel`` chunks; ``staged`` when ``staged_chunk_bytes`` is given
    (the job's group is layer-major and the worker has a staging buffer). Each gets its expected
    GB/s at the job's chunk size (``staged``: ``staged_efficiency`` × the better copy-engine
    GB/s at its DMA chunk size) and its measured ``gemm_slowdown``. Among those within budget
    the highest GB/s wins (ties: the lower slowdown); when none is within budget, the one with
    the lowest slowdown (ties: the higher GB/s).

    Args:
        chunk_bytes: average bytes per chunk of a direct copy (total bytes / ``num_chunks``).
        num_chunks: chunks of a direct copy (runs of adjacent blocks × copied row regions).
        direction: ``"store"`` (GPU → CPU) or ``"load"`` (CPU → GPU).
        thresholds: the measurements (default: :func:`default_thresholds`).
        batch_supported: whether ``cudaMemcpyBatchAsync`` works here
            (``kvoff.ops.batch_copy_supported()``).
        budget: the largest acceptable ``gemm_slowdown`` (``compute_slowdown_budget``, >= 0).
        staged_chunk_bytes: average bytes per DMA chunk if the job were staged (whole
            sub-blocks, runs of adjacent slots), or None when staging is not possible.

    Raises:
        ValueError: for a negative, NaN or infinite size or count (``staged_chunk_bytes``
            too), a negative budget, or an unknown direction.
    """
    if not (0 <= chunk_bytes < math.inf and 0 <= num_chunks < math.inf):
        raise ValueError(
            f"chunk_bytes ({chunk_bytes}) and num_chunks ({num_chunks}) must be finite and "
            "non-negative (bytes per chunk, chunks per copy)"
        )
    if staged_chunk_bytes is not None and not 0 <= staged_chunk_bytes < math.inf:
        raise ValueError(
            f"staged_chunk_bytes ({staged_chunk_bytes}) must be finite and non-negative, or None "
            "when staging is not possible"
        )
    if not budget >= 0:
        raise ValueError(f"budget={budget} must be >= 0 (a fraction: 0.03 is 3 %)")
    thresholds = thresholds or default_thresholds()
    t = thresholds.for_direction(direction)
    candidates = [("memcpy", t.estimate_gbps("memcpy", chunk_bytes))]
    if batch_supported:
        candidates.append(("batch", t.estimate_gbps("batch", chunk_bytes)))
    if num_chunks >= thresholds.min_chunks_for_kernel:
        candidates.append(("kernel", t.estimate_gbps("kernel", chunk_bytes)))
    if staged_chunk_bytes is not None:
        dma = max(
            t.estimate_gbps(m, staged_chunk_bytes)
            for m in (("memcpy", "batch") if batch_supported else ("memcpy",))
        )
        candidates.append(("staged", t.staged_efficiency * dma))
    scored = [(name, gbps, t.gemm_slowdown[name]) for name, gbps in candidates]
    within = [c for c in scored if c[2] <= budget]
    if within:
        name, gbps, slow = max(within, key=lambda c: (c[1], -c[2]))
        return TransferChoice(name, gbps, slow, True)
    name, gbps, slow = min(scored, key=lambda c: (c[2], -c[1]))
    return TransferChoice(name, gbps, slow, False)
