"""Layout-agnostic registration: turn an engine's per-layer KV cache tensors into block rows.

The copy op moves *block rows*: a ``(num_blocks, row_bytes)`` uint8 view whose row stride may
exceed the row. This module finds those views for the layouts engines use, always with the
engine's ``num_blocks`` (``KVCacheConfig.num_blocks``), never a tensor's leading dimension
(docs/design.md invariant 2):

* blocks first, ``(num_blocks, 2, block_size, heads, dim)`` or any contiguous
  ``(num_blocks, ...)``: one row of ``page_size_bytes`` per block;
* K/V first, ``(2, num_blocks, block_size, heads, dim)``: two canonical tensors (K and V), each
  with a half-page row per block;
* kernel blocks: a leading dimension of ``num_blocks × ratio`` (a block split into ``ratio``
  smaller kernel blocks stored back to back) in either layout: still ``num_blocks`` rows;
* Mamba states: one tensor, or a list of state tensors (conv, ssm, ...) that are strided views
  into one padded page per block; only the unpadded bytes are copied (row stride = padded page);
* one tensor shared by layers of different KV cache groups: each layer gets its own rows over
  the same bytes (the groups use different block ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

__all__ = ["KVLayout", "block_row_views"]

KVLayout = Literal["auto", "blocks_first", "kv_first"]


def _byte_rows(
    tensor: torch.Tensor, offset_bytes: int, num_blocks: int, row_bytes: int, stride_bytes: int
) -> torch.Tensor:
    """A ``(num_blocks, row_bytes)`` uint8 view of ``tensor``'s storage starting at
    ``offset_bytes`` (relative to the tensor's first element) with row stride ``stride_bytes``."""
    storage = tensor.untyped_storage()
    base = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    base.set_(storage)
    start = tensor.storage_offset() * tensor.element_size() + offset_bytes
    end = start + (num_blocks - 1) * stride_bytes + row_bytes
    if end > storage.nbytes():
        raise ValueError(
            f"block rows would end at byte {end} but the tensor's storage has "
            f"{storage.nbytes()} bytes"
        )
    return base.as_strided((num_blocks, row_bytes), (stride_bytes, 1), start)


def _leading_ratio(name: str, size: int, num_blocks: int, what: str) -> int:
    if size % num_blocks:
        raise ValueError(
            f"layer {name!r}: {what} has size {size}, which is not a multiple of "
            f"num_blocks={num_blocks}; pass the engine's KVCacheConfig.num_blocks (blocks may be "
            "split into smaller kernel blocks, but a whole number of them per block)"
        )
    return size // num_blocks


def _trailing_contiguous(t: torch.Tensor, first_dim: int) -> bool:
    """Whether dims ``first_dim..`` of ``t`` are laid out contiguously (C order)."""
    expected = 1
    for size, stride in zip(
        reversed(t.shape[first_dim:]), reversed(t.stride()[first_dim:]), strict=True
    ):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _rows_blocks_first(
    name: str, t: torch.Tensor, num_blocks: int, row_bytes: int | None
) -> torch.Tensor:
    ratio = _leading_ratio(name, t.shape[0], num_blocks, "the leading dimension")
    item = t.element_size()
    kernel_bytes = (t.numel() // max(t.shape[0], 1)) * item
    if not _trailing_contiguous(t, 1):
        raise ValueError(
            f"layer {name!r}: a block of the tensor (shape {tuple(t.shape)}, strides "
            f"{t.stride()}) is not contiguous; register blocks-first tensors whose blocks are "
            "contiguous"
        )
    if ratio > 1 and t.stride(0) * item != kernel_bytes:
        raise ValueError(
            f"layer {name!r}: {ratio} kernel blocks per block must be stored back to back "
            f"(stride(0)={t.stride(0)} elements, kernel block {kernel_bytes // item})"
        )
    block_bytes = ratio * kernel_bytes
    stride = t.stride(0) * item * ratio if t.shape[0] > 1 else block_bytes
    row = block_bytes if row_bytes is None else row_bytes
    if row > block_bytes:
        raise ValueError(
            f"layer {name!r}: a block of the tensor holds {block_bytes} bytes but the spec's page "
            f"needs {row}; check the KV cache spec (block_size, heads, head_size, dtype)"
        )
    if num_blocks > 1 and stride < row:
        raise ValueError(
            f"layer {name!r}: blocks of the tensor overlap (shape {tuple(t.shape)}, strides "
            f"{t.stride()}: a block starts every {stride} bytes but holds {row}), so a copy into "
            "one block would change another; register the engine's real KV cache, not an "
            "expanded or overlapping view"
        )
    return _byte_rows(t, 0, num_blocks, row, stride)


def _rows_kv_first(name: str, t: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    ratio = _leading_ratio(
        name, t.shape[1], num_blocks, "dimension 1 (blocks of a K/V-first tensor)"
    )
    item = t.element_size()
    if not _trailing_contiguous(t, 1):
        raise ValueError(
            f"layer {name!r}: the K and V halves of the K/V-first tensor (shape "
            f"{tuple(t.shape)}, strides {t.stride()}) must each be contiguous"
        )
    half_kernel = (t.numel() // (2 * t.shape[1])) * item
    half_row = ratio * half_kernel
    if t.stride(0) * item < num_blocks * half_row:
        raise ValueError(
            f"layer {name!r}: the K and V halves of the K/V-first tensor overlap (shape "
            f"{tuple(t.shape)}, strides {t.stride()}: V starts {t.stride(0) * item} bytes after "
            f"K, whose blocks take {num_blocks * half_row}); register the engine's real KV "
            "cache, not an expanded or overlapping view"
        )
    return [_byte_rows(t, h * t.stride(0) * item, num_blocks, half_row, half_row) for h in range(2)]


def block_row_views(
    name: str,
    kv_cache: torch.Tensor | Sequence[torch.Tensor],
    num_blocks: int,
    spec: object | None = None,
    kv_layout: KVLayout = "auto",
) -> list[torch.Tensor]:
    """The canonical block-row views of one layer's KV cache.

    Args:
        name: the layer's name (for error messages).
        kv_cache: the layer's tensor; for a Mamba layer also a list of state tensors, each
            ``(num_blocks, *state_shape)`` with a block stride of the (padded) page.
        num_blocks: GPU blocks of the engine (``KVCacheConfig.num_blocks``), authoritative.
        spec: the layer's KV cache spec (from ``kvoff.specs``), or None to treat the tensor as
            opaque contiguous blocks-first bytes. With a spec, the layer's bytes are checked
            against ``num_blocks × page_size_bytes``; attention layers may be K/V first; Mamba
            layers copy only their unpadded bytes.
        kv_layout: ``"auto"`` (K/V first when an attention tensor's leading dimension is 2 and
            its second is a multiple of ``num_blocks`` > 2), ``"blocks_first"`` or
            ``"kv_first"``.

    Returns:
        One or more ``(num_blocks, row_bytes)`` uint8 views (K/V first gives two: K rows, V rows;
        a list of Mamba states gives one per state), sharing memory with ``kv_cache``.

    Raises:
        ValueError: when the bytes do not divide into ``num_blocks`` blocks, a block is not
            contiguous, the page does not fit the spec, or ``kv_layout`` is unknown; the message
            names the layer, the shape and the fix.
    """
    from kvoff import specs as S

    if kv_layout not in ("auto", "blocks_first", "kv_first"):
        raise ValueError(
            f"kv_layout must be 'auto', 'blocks_first' or 'kv_first', got {kv_layout!r}"
        )
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if not isinstance(kv_cache, torch.Tensor):
        states = list(kv_cache)
        if not states or not all(isinstance(s, torch.Tensor) for s in states):
            raise ValueError(f"layer {name!r}: expected a tensor or a non-empty list of tensors")
        if spec is not None and not isinstance(spec, S.MambaSpec):
            raise ValueError(
                f"layer {name!r}: a list of tensors is only accepted for Mamba state layers, "
                f"got spec {type(spec).__name__}"
            )
        rows = []
        for i, s in enumerate(states):
            if s.shape[0] != num_blocks:
                raise ValueError(
                    f"layer {name!r}: Mamba state {i} has {s.shape[0]} blocks (shape "
                    f"{tuple(s.shape)}), expected num_blocks={num_blocks}"
                )
            state_bytes = (s.numel() // num_blocks) * s.element_size()
            rows.append(_rows_blocks_first(f"{name}[{i}]", s, num_blocks, state_bytes))
        if spec is not None:
            copied = sum(r.shape[1] for r in rows)
            if copied != spec.page_size_unpadded:  # type: ignore[attr-defined]
                raise ValueError(
                    f"layer {name!r}: the Mamba states hold {copied} bytes per block but the "
                    f"spec's unpadded page is {spec.page_size_unpadded} bytes"  # type: ignore[attr-defined]
                )
        return rows

    t = kv_cache
    if t.dim() == 0 or t.numel() == 0:
        raise ValueError(f"layer {name!r}: empty or 0-d KV cache tensor (shape {tuple(t.shape)})")
    attention = isinstance(spec, (S.FullAttentionSpec, S.SlidingWindowSpec))
    layout = kv_layout
    if layout == "auto":
        layout = (
            "kv_first"
            if attention and t.dim() >= 2 and t.shape[0] == 2 and num_blocks > 2
            and t.shape[1] % num_blocks == 0
            else "blocks_first"
        )  # fmt: skip
    if layout == "kv_first":
        if t.dim() < 2 or t.shape[0] != 2:
            raise ValueError(
                f"layer {name!r}: kv_layout='kv_first' needs a (2, num_blocks, ...) tensor, got "
                f"shape {tuple(t.shape)}"
            )
        rows = _rows_kv_first(name, t, num_blocks)
    else:
        row_bytes = None
        if isinstance(spec, S.MambaSpec):
            row_bytes = spec.page_size_unpadded
        rows = [_rows_blocks_first(name, t, num_blocks, row_bytes)]
    if spec is not None:
        page = spec.page_size_bytes  # type: ignore[attr-defined]
        per_block = (t.numel() * t.element_size()) // num_blocks
        if per_block != page:
            raise ValueError(
                f"layer {name!r}: the tensor holds {per_block} bytes per block (shape "
                f"{tuple(t.shape)}, {t.dtype}, num_blocks={num_blocks}) but its spec's "
                f"page_size_bytes is {page}; the tensor and the KVCacheConfig disagree"
            )
    return rows
