"""Python entry points of the torch ops in ``torch.ops.kvoff`` (module ``kvoff._C``).

Every schema is defined in C++ (``cpp/ops/ops.cpp``); the CPU kernel is in
``cpp/ops/copy_blocks_cpu.cpp`` and the CUDA kernel in ``cuda/`` (CUDA builds only). This module
adds the Python wrappers :func:`copy_blocks` and :func:`batch_copy_supported`, the tuple
:data:`MECHANISMS`, and the fake (meta) kernels that let the ops run under ``torch.compile`` and
``FakeTensorMode``.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvoff import _C  # noqa: F401  (loads the library that defines torch.ops.kvoff.*)
from kvoff.transfer import OP_MECHANISMS

__all__ = ["MECHANISMS", "batch_copy_supported", "copy_blocks", "copy_blocks_fast"]

_PREFIX = "kvoff.copy_blocks: "

#: Names accepted by ``copy_blocks(..., mechanism=...)``; see :func:`copy_blocks`.
MECHANISMS: tuple[str, ...] = OP_MECHANISMS  # one list, shared with config validation


def _check_options(mechanism: object, kernel_blocks: object) -> None:
    """Raise ValueError (TypeError for wrong types) with the C++ op's message style."""
    if not isinstance(mechanism, str) or mechanism not in MECHANISMS:
        choices = ", ".join(f"'{m}'" for m in MECHANISMS)
        raise ValueError(
            f"{_PREFIX}mechanism={mechanism!r} is not one of {choices}. Pass one of these "
            "names (kvoff.ops.MECHANISMS), or 'auto' to let kvoff choose."
        )
    if isinstance(kernel_blocks, bool) or not isinstance(kernel_blocks, int):
        raise TypeError(
            f"{_PREFIX}kernel_blocks={kernel_blocks!r} is not an int; pass 0 for the default "
            "grid-size cap (10% of the GPU's SMs) or a positive number of thread blocks."
        )
    if kernel_blocks < 0:
        raise ValueError(
            f"{_PREFIX}kernel_blocks={kernel_blocks} is negative; pass 0 for the default "
            "grid-size cap (10% of the GPU's SMs) or a positive number of thread blocks."
        )


def batch_copy_supported() -> bool:
    """Whether ``mechanism="batch"`` really issues one ``cudaMemcpyBatchAsync`` per call here.

    True when kvoff was built against CUDA >= 12.8, a GPU is visible, the driver is >= 12.8
    (``cudaDriverGetVersion() >= 12080``) and no earlier batch call in this process was refused
    by the driver as unsupported (the verdict is cached per process). False on CPU builds and
    machines without a GPU. Where it is False, ``mechanism="batch"`` silently runs
    ``"memcpy"`` instead; ``"batch"`` also falls back, per call, on the legacy default stream,
    which the batch API refuses (run the copy on a side stream).

    This is ``torch.ops.kvoff.batch_copy_supported``; it never raises.
    """
    return bool(torch.ops.kvoff.batch_copy_supported.default())


def copy_blocks(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    src_block_ids: torch.Tensor | Sequence[int],
    dst_block_ids: torch.Tensor | Sequence[int],
    mechanism: str = "auto",
    kernel_blocks: int = 0,
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
        mechanism: how the bytes move, one of :data:`MECHANISMS`:

            - ``"auto"`` (default): a compiled-in rule on the GPU: ``"memcpy"`` when the copy
              calls would move at least 256 KiB each on average, else ``"kernel"``. Callers
              with measured thresholds (the worker) resolve it themselves and pass a name.
            - ``"memcpy"``: one ``cudaMemcpyAsync`` (``cudaMemcpy2DAsync`` for strided rows)
              per run of blocks adjacent on both sides, per tensor pair. Each call costs
              ~2 us (docs/design.md, "Moving bytes"), which caps a 32 KiB block near 14 GB/s
              against ~50-55 GB/s of PCIe Gen5.
            - ``"batch"``: the same runs in ONE ``cudaMemcpyBatchAsync`` call per op call
              (CUDA >= 12.8 build and driver). Falls back to ``"memcpy"`` where
              :func:`batch_copy_supported` is False and on the legacy default stream.
            - ``"kernel"``: one gather/scatter kernel for all pairs and blocks, reading and
              writing pinned host memory through its device pointer, on at most
              ``kernel_blocks`` thread blocks of 512 threads (one warp per row at a time,
              16-byte accesses when aligned). SM kernels read host memory slower than they
              write it (~35 vs ~53 GB/s on H100, docs/design.md).
            - ``"per_block"``: the naive baseline for benchmarks: one ``cudaMemcpyAsync`` per
              block per pair, no coalescing.

            On the CPU, ``"per_block"`` is one ``memcpy`` per row per pair on the calling
            thread; every other name is the parallel run-coalesced memcpy.
        kernel_blocks: grid-size cap (thread blocks, >= 0) of ``"kernel"``; ``0`` means
            ``max(1, floor(0.10 * SMs))`` of the device (13 on a 132-SM H100), so the copy
            runs on at most 10% of the SMs. Ignored by the other mechanisms.

    Devices:
        CPU: every ``src`` and ``dst`` tensor on the CPU; a parallel memcpy, done when the call
        returns. CUDA builds also copy GPU to GPU (one device), GPU to pinned CPU and pinned CPU
        to GPU (the CPU side must be pinned: ``torch.empty(..., pin_memory=True)``). CUDA copies
        are enqueued on the current CUDA stream of the GPU side's device and are asynchronous:
        synchronize that stream (or record an event) before reading a CPU destination or
        freeing or reusing a CPU source. Sources and destinations must not overlap in memory.

    Raises:
        ValueError: an unknown ``mechanism`` or a negative ``kernel_blocks`` (raised by this
            wrapper and by the op); empty ``src`` or ``len(src) != len(dst)``; a tensor or id
            tensor that is not dense (sparse, mkldnn: naming it and its layout); a 0-d tensor;
            a pair whose dtypes or row sizes differ; rows that are not contiguous or
            ``stride(0)`` smaller than the row; id tensors that are not 1-D ``torch.int64`` or
            of different lengths; a repeated destination id.
        TypeError: ``src`` or ``dst`` given as one tensor, or as anything but a list or tuple
            of tensors; id sequences (not tensors) that do not hold integers, or a
            ``kernel_blocks`` that is not an int; raised by this wrapper before the op runs.
        IndexError: a negative id, or an id ``>= size(0)`` of some tensor on its side (ids in
            sequences beyond int64, such as ``2**63``, are refused by this wrapper, naming
            the position and value, before the op runs).
        RuntimeError: ``src`` (or ``dst``) tensors on different devices; id tensors not on the
            CPU; an unsupported device combination; an unpinned CPU tensor in a CPU-GPU copy;
            a CUDA failure.

        Every message names the bad value (pair index, id position and value, shapes, dtypes,
        devices) and the fix. All arguments are checked before anything is copied, so a call
        that raises leaves every ``dst`` tensor unchanged.
    """
    _check_options(mechanism, kernel_blocks)
    torch.ops.kvoff.copy_blocks.default(
        _as_tensor_list(src, "src"),
        _as_tensor_list(dst, "dst"),
        _as_block_ids(src_block_ids, "src_block_ids"),
        _as_block_ids(dst_block_ids, "dst_block_ids"),
        mechanism,
        kernel_blocks,
    )


def copy_blocks_fast(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    src_block_ids: np.ndarray,
    dst_block_ids: np.ndarray,
    mechanism: str,
    kernel_blocks: int = 0,
) -> None:
    """:func:`copy_blocks` for callers on a hot path (the worker, per job): lists of tensors,
    ``(N,)`` int64 NumPy id arrays and a mechanism name known to be valid; skips the wrapper's
    conversions and option checks (the op itself still validates every argument and raises the
    errors :func:`copy_blocks` documents).
    """
    torch.ops.kvoff.copy_blocks.default(
        src,
        dst,
        torch.from_numpy(src_block_ids),
        torch.from_numpy(dst_block_ids),
        mechanism,
        kernel_blocks,
    )


def _as_tensor_list(tensors: Iterable[torch.Tensor], name: str) -> list[torch.Tensor]:
    """``tensors`` (a list, tuple or other iterable of tensors, e.g. a dict's values) as a list.

    Raises:
        TypeError: one tensor rather than a collection of them (its rows would be taken as the
            tensors, a copy with another meaning), something that is not iterable, or an item
            that is not a tensor.
    """
    if isinstance(tensors, torch.Tensor):
        raise TypeError(
            f"kvoff.copy_blocks: {name} must be a list or tuple of tensors (one per layer), got "
            f"one tensor of shape {list(tensors.shape)}; pass [{name}]"
        )
    items = None
    if not isinstance(tensors, (str, bytes)):
        with contextlib.suppress(TypeError):
            items = list(tensors)
    if items is None:
        raise TypeError(
            f"kvoff.copy_blocks: {name} must be a list or tuple of tensors (one per layer), got "
            f"{type(tensors).__name__} {repr(tensors)[:80]}"
        )
    for k, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"kvoff.copy_blocks: {name}[{k}] must be a tensor, got {type(t).__name__} "
                f"{repr(t)[:80]}"
            )
    return items


def _as_block_ids(ids: torch.Tensor | Sequence[int], name: str) -> torch.Tensor:
    """Return ``ids`` as a tensor; sequences become 1-D int64 CPU tensors.

    Tensors pass through unchanged, so that the op reports a wrong dtype, device or layout
    itself.

    Raises:
        TypeError: an id that is not an integer (naming its position and value).
        IndexError: an id that does not fit in int64, such as ``2**63`` (naming its position
            and value): NumPy would otherwise wrap it to a negative id or read the list as
            floats.
    """
    if isinstance(ids, torch.Tensor):
        return ids
    arr = np.asarray(ids)
    if arr.size == 0:
        return torch.empty(0, dtype=torch.int64)
    kind = arr.dtype.kind
    if kind == "u" and arr.dtype.itemsize >= 8:  # uint64: 2**63 and up would wrap
        flat = arr.reshape(-1)
        too_big = np.flatnonzero(flat > np.uint64(2**63 - 1))
        if too_big.size:
            _check_int64_ids(flat[too_big[:1]], name, arr.dtype, first=int(too_big[0]))
    elif kind not in "iu":
        if kind != "O" and isinstance(ids, np.ndarray):
            raise TypeError(
                f"{_PREFIX}{name} must hold integers, got values of dtype {arr.dtype} "
                f"(first: {arr.reshape(-1)[0]!r}); pass block ids as ints."
            )
        # A sequence NumPy did not read as integers: Python ints beyond int64 make it object
        # or float64 ([1, 2**63]); look at the items themselves.
        items = np.asarray(ids, dtype=object)
        _check_int64_ids(items.reshape(-1), name, arr.dtype)
        return torch.from_numpy(np.ascontiguousarray(items, dtype=np.int64))
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))


def _check_int64_ids(flat: np.ndarray, name: str, dtype: np.dtype, first: int = 0) -> None:
    """Raise for the first of ``flat`` (ids from position ``first`` on) that is not an integer
    (TypeError) or that does not fit in int64 (IndexError: it is no row of any tensor),
    naming its position and value. ``dtype``: what NumPy made of the whole sequence."""
    side = name.removesuffix("_block_ids")
    for i, item in enumerate(flat.tolist(), start=first):
        if isinstance(item, (bool, np.bool_)) or not hasattr(item, "__index__"):
            raise TypeError(
                f"{_PREFIX}{name} must hold integers, got values of dtype {dtype} ({name}[{i}] "
                f"= {item!r} is a {type(item).__name__}); pass block ids as ints."
            )
        v = operator.index(item)
        if v < 0:
            raise IndexError(
                f"{_PREFIX}{name}[{i}] = {v} is negative; block ids are row indices in "
                f"[0, size(0)) of every {side} tensor (negative indexing is not supported)."
            )
        if v >= 2**63:
            raise IndexError(
                f"{_PREFIX}{name}[{i}] = {v} is out of range: it does not fit in int64, so no "
                f"{side} tensor has that row; block ids are row indices in [0, size(0)) of "
                f"every {side} tensor. Pass ids of existing blocks."
            )


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
    mechanism: str = "auto",
    kernel_blocks: int = 0,
) -> None:
    """Fake kernel: the metadata checks of the real kernels; mutates ``dst``, returns None.

    Id values, strides and pinnedness are data or layout that the real kernels check.
    """
    _check_options(mechanism, kernel_blocks)
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
            if t.layout != torch.strided:
                raise ValueError(
                    f"{_PREFIX}{side}[{k}] is a {t.layout} tensor (shape {list(t.shape)}); "
                    "block tensors must be dense (torch.strided) with dim 0 = blocks. Convert "
                    "it with .to_dense(), or allocate the cache as a dense tensor."
                )
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
        if ids.layout != torch.strided:
            raise ValueError(
                f"{_PREFIX}{name} is a {ids.layout} tensor (shape {list(ids.shape)}); block ids "
                "must be a dense 1-D int64 CPU tensor. Convert them with .to_dense(), or pass a "
                "list of ints."
            )
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
