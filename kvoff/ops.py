"""Python entry points of the torch ops in ``torch.ops.kvoff`` (module ``kvoff._C``).

Every schema is defined in C++ (``cpp/ops/ops.cpp``); the CPU kernel is in
``cpp/ops/copy_blocks_cpu.cpp`` and the CUDA kernel in ``cuda/`` (CUDA builds only). This module
adds the Python wrapper :func:`copy_blocks` and the fake (meta) kernels that let the ops run
under ``torch.compile`` and ``FakeTensorMode``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvoff import _C  # noqa: F401  (loads the library that defines torch.ops.kvoff.*)

__all__ = ["copy_blocks"]

_PREFIX = "kvoff.copy_blocks: "


def copy_blocks(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    src_block_ids: torch.Tensor | Sequence[int],
    dst_block_ids: torch.Tensor | Sequence[int],
) -> None:
    """Copy block rows of several tensor pairs (layers) in one call.

    For every pair ``k`` and every position ``i``, row ``src_block_ids[i]`` of ``src[k]`` is
    copied to row ``dst_block_ids[i]`` of ``dst[k]``::

        for k in range(len(src)):
            dst[k][dst_block_ids] = src[k][src_block_ids]

    Bytes are copied as they are, never converted. ``dst`` is modified in place; nothing is
    returned. This is ``torch.ops.kvoff.copy_blocks`` with id lists converted to tensors.

    Args:
        src: ``P >= 1`` source tensors, typically one per layer (or per K/V half). Dim 0 of
            each indexes blocks; the remaining dims form one row, which must be contiguous in
            memory (``stride(-1) == 1`` and so on). The row stride ``stride(0)`` may be larger
            than the row (a view into a bigger tensor, a K/V-split layout) but not smaller.
            Pairs may have different row sizes and dtypes from each other.
        dst: ``P`` destination tensors with the same layout rules; ``dst[k]`` has the dtype of
            ``src[k]`` and the same row size in elements (product of ``shape[1:]``; the shapes
            themselves may differ, e.g. ``(n, 2, 16, 8, 128)`` and ``(m, 32768)``), while
            ``size(0)`` (the number of blocks) may differ.
        src_block_ids: ``N`` source block ids (row indices in ``[0, size(0))`` of every
            ``src[k]``): a 1-D ``torch.int64`` CPU tensor, or any sequence of integers (a list,
            ``range``, NumPy array), converted to one. ``N == 0`` is a no-op.
        dst_block_ids: ``N`` destination block ids, in ``[0, size(0))`` of every ``dst[k]``,
            with no id repeated (two writes to one block would race). Same forms as
            ``src_block_ids``.

    Devices:
        CPU: every ``src`` and ``dst`` tensor on the CPU; a parallel memcpy, done when the call
        returns. CUDA builds also copy GPU to GPU (one device), GPU to pinned CPU and pinned CPU
        to GPU (the CPU side must be pinned: ``torch.empty(..., pin_memory=True)``). CUDA copies
        are enqueued on the current CUDA stream of the GPU side's device and are asynchronous:
        synchronize that stream (or record an event) before reading a CPU destination or
        freeing or reusing a CPU source. Sources and destinations must not overlap in memory.

    Raises:
        ValueError: empty ``src`` or ``len(src) != len(dst)``; a 0-d tensor; a pair whose
            dtypes or row sizes differ; rows that are not contiguous or ``stride(0)`` smaller
            than the row; id tensors that are not 1-D ``torch.int64`` or of different lengths;
            a repeated destination id.
        TypeError: id sequences (not tensors) that do not hold integers; raised by this
            wrapper before the op runs.
        IndexError: a negative id, or an id ``>= size(0)`` of some tensor on its side.
        RuntimeError: ``src`` (or ``dst``) tensors on different devices; id tensors not on the
            CPU; an unsupported device combination; an unpinned CPU tensor in a CPU-GPU copy;
            a CUDA failure.

        Every message names the bad value (pair index, id position and value, shapes, dtypes,
        devices) and the fix. All arguments are checked before anything is copied, so a call
        that raises leaves every ``dst`` tensor unchanged.
    """
    torch.ops.kvoff.copy_blocks.default(
        list(src),
        list(dst),
        _as_block_ids(src_block_ids, "src_block_ids"),
        _as_block_ids(dst_block_ids, "dst_block_ids"),
    )


def _as_block_ids(ids: torch.Tensor | Sequence[int], name: str) -> torch.Tensor:
    """Return ``ids`` as a tensor; sequences become 1-D int64 CPU tensors.

    Tensors pass through unchanged, so that the op reports a wrong dtype or device itself.
    """
    if isinstance(ids, torch.Tensor):
        return ids
    arr = np.asarray(ids)
    if arr.size == 0:
        return torch.empty(0, dtype=torch.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"{_PREFIX}{name} must hold integers, got values of dtype {arr.dtype} "
            f"(first: {arr.reshape(-1)[0]!r}); pass block ids as ints."
        )
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))


def _row_numel(t: torch.Tensor) -> int:
    n = 1
    for s in t.shape[1:]:
        n *= s
    return n


@torch.library.register_fake("kvoff::copy_blocks")
def _copy_blocks_fake(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    src_block_ids: torch.Tensor,
    dst_block_ids: torch.Tensor,
) -> None:
    """Fake kernel: the metadata checks of the real kernels; mutates ``dst``, returns None.

    Id values, strides and pinnedness are data or layout that the real kernels check.
    """
    if len(src) == 0:
        raise ValueError(
            f"{_PREFIX}src is an empty list; pass one tensor per layer (or per K/V half)."
        )
    if len(src) != len(dst):
        raise ValueError(
            f"{_PREFIX}src has {len(src)} tensors but dst has {len(dst)}; pass one dst tensor "
            "for every src tensor (pair k copies src[k] -> dst[k])."
        )
    for k, (s, d) in enumerate(zip(src, dst, strict=True)):
        for side, t in (("src", s), ("dst", d)):
            if t.dim() == 0:
                raise ValueError(
                    f"{_PREFIX}{side}[{k}] is a 0-d tensor; block tensors need dim 0 = blocks, "
                    "for example view it as (num_blocks, -1)."
                )
        if s.dtype != d.dtype:
            raise ValueError(
                f"{_PREFIX}pair {k}: src[{k}] is {s.dtype} but dst[{k}] is {d.dtype}; both "
                "tensors of a pair must have the same dtype (bytes are copied, not converted). "
                f"Allocate or view dst[{k}] with src[{k}]'s dtype."
            )
        if _row_numel(s) != _row_numel(d):
            raise ValueError(
                f"{_PREFIX}pair {k}: a row of src[{k}] has {_row_numel(s)} elements (shape "
                f"{list(s.shape)}) but a row of dst[{k}] has {_row_numel(d)} (shape "
                f"{list(d.shape)}); both tensors of a pair must have the same row size (product "
                f"of sizes[1:]). Check that pair {k} pairs the same layer on both sides."
            )
    for side, tensors in (("src", src), ("dst", dst)):
        for k, t in enumerate(tensors):
            if t.device != tensors[0].device:
                raise RuntimeError(
                    f"{_PREFIX}{side}[{k}] is on {t.device} but {side}[0] is on "
                    f"{tensors[0].device}; every {side} tensor must be on one device. Move "
                    f'{side}[{k}] with .to("{tensors[0].device}").'
                )
    for name, ids in (("src_block_ids", src_block_ids), ("dst_block_ids", dst_block_ids)):
        if ids.dtype != torch.int64:
            raise ValueError(
                f"{_PREFIX}{name} has dtype {ids.dtype}; block ids must be torch.int64. Convert "
                "them with .to(torch.int64) (kvoff.copy_blocks accepts Python lists and "
                "converts them for you)."
            )
        if ids.device.type != "cpu":
            raise RuntimeError(
                f"{_PREFIX}{name} is on {ids.device}; block ids must be a CPU tensor (the host "
                "plans the copy). Move them with .cpu()."
            )
        if ids.dim() != 1:
            raise ValueError(
                f"{_PREFIX}{name} has shape {list(ids.shape)}; block ids must be a 1-D tensor. "
                "Flatten it with .reshape(-1)."
            )
    if src_block_ids.numel() != dst_block_ids.numel():
        raise ValueError(
            f"{_PREFIX}src_block_ids has {src_block_ids.numel()} ids but dst_block_ids has "
            f"{dst_block_ids.numel()}; pass one destination id for every source id."
        )
