"""KV cache specs: how many bytes one GPU block of one layer occupies.

Only full attention exists in this first cut; sliding-window, MLA, Mamba and per-layer page
sizes come with the spec issue. Names follow DESIGN.md's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FullAttentionSpec", "dtype_from_name"]

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_from_name(dtype: torch.dtype | str) -> torch.dtype:
    """Return the torch dtype for ``dtype`` (a ``torch.dtype`` or a name such as ``"bf16"``).

    Raises:
        ValueError: for an unknown name; the message lists the accepted names.
        TypeError: for anything that is neither a ``torch.dtype`` nor a string.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.").lower()
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise ValueError(
            f"unknown KV cache dtype {dtype!r}; use a torch.dtype or one of {sorted(_DTYPE_NAMES)}"
        )
    raise TypeError(f"dtype must be a torch.dtype or a string, got {type(dtype).__name__}")


def _check_positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class FullAttentionSpec:
    """One full-attention layer's KV cache block.

    A GPU block of this layer holds K and V for ``block_size`` tokens:
    a ``(2, block_size, num_kv_heads, head_size)`` array of ``dtype``.

    Attributes:
        block_size: tokens per GPU block.
        num_kv_heads: KV heads of the layer on one tensor-parallel rank.
        head_size: elements per head.
        dtype: element type of the KV cache (a ``torch.dtype``; names such as ``"bf16"`` are
            accepted and converted).

    Raises:
        ValueError: when a size is not a positive int or the dtype name is unknown.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_size"):
            _check_positive_int("FullAttentionSpec", name, getattr(self, name))
        object.__setattr__(self, "dtype", dtype_from_name(self.dtype))

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one GPU block of this layer: 2 (K and V) × block_size × num_kv_heads ×
        head_size × dtype size (DESIGN.md, "page_size_bytes")."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token costs in this layer (``page_size_bytes / block_size``)."""
        return self.page_size_bytes // self.block_size
