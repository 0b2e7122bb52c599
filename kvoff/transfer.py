"""Choosing how a transfer job moves its bytes (DESIGN.md "Moving bytes").

A job is cut into *chunks*: one per run of adjacent blocks (source and destination ids both
consecutive) per copied tensor (a layer, or a K or V half). Three mechanisms move chunks between
GPU memory and pinned CPU memory (``kvoff.ops.copy_blocks``, ``mechanism=``):

* ``"memcpy"``: one copy call per chunk. Each call costs about 2 µs of driver and DMA setup, so
  a 32 KiB chunk tops out near 14 GB/s against ~50-55 GB/s of PCIe Gen5 (DESIGN.md).
* ``"batch"``: one ``cudaMemcpyBatchAsync`` call per job (CUDA ≥ 12.8 driver and runtime),
  which amortizes the setup over the batch; falls back to ``"memcpy"`` where unsupported.
* ``"kernel"``: one gather/scatter kernel launch per job on a few SMs, reading or writing pinned
  host memory through its device pointer. No per-chunk cost, but SMs read host memory slower
  than they write it (~35 vs ~53 GB/s on H100, DESIGN.md), so it suits stores better than loads.

:func:`choose_mechanism` picks one per job from the average chunk size, the number of chunks and
the direction, using :class:`TransferThresholds`: the crossover chunk sizes measured on the
device by ``kvoff bench transfer --sweep`` (which can write them with ``--write-thresholds``),
or, until a measurement exists, the defaults shipped in ``kvoff/data/transfer_thresholds.json``,
derived from the published numbers above (their ``source`` field says which). Override with
the ``KVOFF_TRANSFER_THRESHOLDS`` environment variable (a path to such a JSON file) or by
passing thresholds to the worker.
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from pathlib import Path
from typing import Literal

import pydantic
from pydantic.dataclasses import dataclass

__all__ = [
    "ALL_MECHANISMS",
    "COPY_MECHANISMS",
    "DirectionThresholds",
    "TransferThresholds",
    "choose_mechanism",
    "default_thresholds",
    "load_thresholds",
]

Direction = Literal["store", "load"]
"""``"store"``: GPU → CPU (device to host); ``"load"``: CPU → GPU (host to device)."""

ALL_MECHANISMS: tuple[str, ...] = ("auto", "memcpy", "batch", "kernel", "per_block")
"""Every name ``kvoff.ops.copy_blocks`` accepts (``kvoff.ops.MECHANISMS`` is this tuple; it lives
here so that configuration can be validated without loading the extension)."""

COPY_MECHANISMS: tuple[str, ...] = ("memcpy", "batch", "kernel")
"""The mechanisms :func:`choose_mechanism` chooses among (``kvoff.ops.copy_blocks`` also
accepts ``"auto"`` and the benchmark baseline ``"per_block"``)."""

THRESHOLDS_ENV = "KVOFF_TRANSFER_THRESHOLDS"
"""Environment variable naming a thresholds JSON file that replaces the packaged defaults."""

_CONFIG = pydantic.ConfigDict(extra="forbid")


@dataclass(frozen=True, config=_CONFIG)
class DirectionThresholds:
    """Crossover chunk sizes of one direction, in bytes of an average chunk (a coalesced run of
    one tensor: blocks in the run × row bytes).

    Attributes:
        kernel_below_bytes: chunks smaller than this go to the kernel when ``"batch"`` is
            available (the kernel beats one batched copy call).
        batch_below_bytes: chunks in ``[kernel_below_bytes, batch_below_bytes)`` go to
            ``"batch"``; larger ones to ``"memcpy"``, whose per-call cost no longer matters.
        kernel_below_bytes_without_batch: where ``"batch"`` is unavailable, chunks smaller than
            this go to the kernel and the others to ``"memcpy"``.
    """

    kernel_below_bytes: int = pydantic.Field(ge=0)
    batch_below_bytes: int = pydantic.Field(ge=0)
    kernel_below_bytes_without_batch: int = pydantic.Field(ge=0)

    @pydantic.model_validator(mode="after")
    def _ordered(self) -> DirectionThresholds:
        if self.batch_below_bytes < self.kernel_below_bytes:
            raise ValueError(
                f"batch_below_bytes={self.batch_below_bytes} is below kernel_below_bytes="
                f"{self.kernel_below_bytes}; the batch range [kernel_below_bytes, "
                "batch_below_bytes) must not be negative: raise batch_below_bytes"
            )
        return self


@dataclass(frozen=True, config=_CONFIG)
class TransferThresholds:
    """What ``mechanism="auto"`` decides from, per direction.

    Attributes:
        store: thresholds for GPU → CPU jobs.
        load: thresholds for CPU → GPU jobs.
        min_chunks_for_kernel: jobs with fewer chunks than this always use copy calls (a few
            calls cost less than a kernel launch plus its descriptor upload).
        source: where the numbers come from (the device and command of a measurement, or the
            published numbers they were derived from).
    """

    store: DirectionThresholds
    load: DirectionThresholds
    min_chunks_for_kernel: int = pydantic.Field(default=4, ge=1)
    source: str = ""

    def for_direction(self, direction: Direction) -> DirectionThresholds:
        """The thresholds of ``"store"`` or ``"load"``.

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
    packaged defaults (``kvoff/data/transfer_thresholds.json``).

    Raises:
        ValueError: when the file is missing, is not JSON, or does not match
            :class:`TransferThresholds` (the message names the file and the bad field).
    """
    if path is None:
        path = os.environ.get(THRESHOLDS_ENV) or None
    if path is None:
        text = resources.files("kvoff").joinpath("data/transfer_thresholds.json").read_text()
        where = "the packaged kvoff/data/transfer_thresholds.json"
    else:
        where = str(path)
        try:
            text = Path(path).read_text()
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
    try:
        return pydantic.TypeAdapter(TransferThresholds).validate_python(data)
    except pydantic.ValidationError as exc:
        raise ValueError(f"transfer thresholds file {where} is invalid:\n{exc}") from None


@functools.cache
def default_thresholds() -> TransferThresholds:
    """:func:`load_thresholds` with no path, read once per process (clear with
    ``default_thresholds.cache_clear()`` after changing ``$KVOFF_TRANSFER_THRESHOLDS``)."""
    return load_thresholds()


def choose_mechanism(
    chunk_bytes: float,
    num_chunks: int,
    direction: Direction,
    thresholds: TransferThresholds | None = None,
    *,
    batch_supported: bool = True,
) -> str:
    """The mechanism for a job: ``"memcpy"``, ``"batch"`` or ``"kernel"``.

    Args:
        chunk_bytes: average bytes per chunk (total bytes / ``num_chunks``).
        num_chunks: chunks of the job (runs of adjacent blocks × copied tensors).
        direction: ``"store"`` (GPU → CPU) or ``"load"`` (CPU → GPU).
        thresholds: the crossovers (default: :func:`default_thresholds`).
        batch_supported: whether ``cudaMemcpyBatchAsync`` works here
            (``kvoff.ops.batch_copy_supported()``).

    Raises:
        ValueError: for a negative size or count, or an unknown direction.
    """
    if chunk_bytes < 0 or num_chunks < 0:
        raise ValueError(
            f"chunk_bytes ({chunk_bytes}) and num_chunks ({num_chunks}) must be non-negative"
        )
    thresholds = thresholds or default_thresholds()
    t = thresholds.for_direction(direction)
    if num_chunks < thresholds.min_chunks_for_kernel:
        return "memcpy"
    if batch_supported:
        if chunk_bytes < t.kernel_below_bytes:
            return "kernel"
        return "batch" if chunk_bytes < t.batch_below_bytes else "memcpy"
    return "kernel" if chunk_bytes < t.kernel_below_bytes_without_batch else "memcpy"
