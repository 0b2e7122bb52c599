"""KV cache specs: how many bytes one GPU block of one layer occupies, and the GPU cache plan.

Names follow docs/design.md's vocabulary. Every spec is a frozen, validated dataclass with a
``block_size`` (tokens per GPU block), ``page_size_bytes`` (bytes of one block of the layer, or
of all layers of a :class:`UniformTypeKVCacheSpecs`) and ``max_num_blocks(max_model_len)`` (GPU
blocks ONE request of that many tokens needs in this layer's group). :class:`KVCacheTensor`,
:class:`KVCacheGroupSpec` and :class:`KVCacheConfig` describe an engine's GPU cache plan
(built by :func:`kvoff.get_kv_cache_config`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = [
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "MambaSpec",
    "SlidingWindowSpec",
    "UniformTypeKVCacheSpecs",
    "cdiv",
    "dtype_from_name",
]

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


INT64_LIMIT = 2**63
"""Counts and sizes reach the C++ core as int64: every one must be below this."""


def _check_positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")
    if value >= INT64_LIMIT:
        raise ValueError(
            f"{owner}.{name}={value} is too large: the C++ core takes int64, so use a value "
            "below 2**63"
        )


def _check_non_negative_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{owner}.{name} must be an int >= 0, got {value!r}")
    if value >= INT64_LIMIT:
        raise ValueError(
            f"{owner}.{name}={value} is too large: the C++ core takes int64, so use a value "
            "below 2**63"
        )


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b`` (``-(-a // b)``)."""
    return -(-a // b)


def _check_model_len(max_model_len: object) -> int:
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(
            f"max_model_len must be a positive number of tokens, got {max_model_len!r}"
        )
    return max_model_len


@dataclass(frozen=True)
class _AttentionSpec:
    """Shared fields and page arithmetic of the attention specs (not public).

    page_size_bytes = ``_KV_FACTOR`` × block_size × num_kv_heads × head_size × dtype size
    (docs/design.md, "page_size_bytes": 2 for K and V, 1 for MLA's single latent).
    """

    _KV_FACTOR: ClassVar[int] = 2
    _POSITIVE: ClassVar[tuple[str, ...]] = ("block_size", "num_kv_heads", "head_size")

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in self._POSITIVE:
            _check_positive_int(type(self).__name__, name, getattr(self, name))
        object.__setattr__(self, "dtype", dtype_from_name(self.dtype))

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one GPU block of this layer: 2 (K and V; 1 for MLA) × block_size ×
        num_kv_heads × head_size × dtype size."""
        return (
            self._KV_FACTOR * self.block_size * self.num_kv_heads * self.head_size
            * self.dtype.itemsize
        )  # fmt: skip

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token costs in this layer (``page_size_bytes / block_size``)."""
        return self.page_size_bytes // self.block_size

    def max_num_blocks(self, max_model_len: int) -> int:
        """GPU blocks one request of ``max_model_len`` tokens needs: ``cdiv(max_model_len,
        block_size)`` (every token is kept).

        Raises:
            ValueError: when ``max_model_len`` is not a positive int.
        """
        return cdiv(_check_model_len(max_model_len), self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(_AttentionSpec):
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


@dataclass(frozen=True)
class SlidingWindowSpec(_AttentionSpec):
    """One sliding-window attention layer's KV cache block.

    The block holds K and V for ``block_size`` tokens like :class:`FullAttentionSpec`, but the
    layer only attends to the last ``sliding_window`` tokens, so blocks that fall wholly outside
    the window are freed (their block-table entries become the null block 0).

    Attributes:
        block_size: tokens per GPU block.
        num_kv_heads: KV heads of the layer on one tensor-parallel rank.
        head_size: elements per head.
        dtype: element type (a ``torch.dtype`` or a name such as ``"bf16"``).
        sliding_window: tokens the layer attends to (the current token included).

    Raises:
        ValueError: when a size is not a positive int or the dtype name is unknown.
    """

    _POSITIVE: ClassVar[tuple[str, ...]] = (
        "block_size", "num_kv_heads", "head_size", "sliding_window"
    )  # fmt: skip

    sliding_window: int

    def max_num_blocks(self, max_model_len: int) -> int:
        """GPU blocks one request of ``max_model_len`` tokens needs at most in this group.

        ``min(cdiv(L, block_size), cdiv(sliding_window - 1, block_size) + 1)``. Reasoning: to
        compute the next token the layer needs the ``sliding_window - 1`` previous tokens plus
        the current one. Those ``sliding_window - 1`` tokens fill ``cdiv(sliding_window - 1,
        block_size)`` blocks when they start at a block boundary, but in general they straddle
        one more block (the window's start lies inside a block and its end inside another), and
        the block receiving the current token is counted by that extra one; so a request never
        holds more than ``cdiv(sliding_window - 1, block_size) + 1`` real blocks — and never more
        than a full-attention layer would (``cdiv(L, block_size)``). The same bound as vLLM's
        sliding-window manager for one decode step.

        Raises:
            ValueError: when ``max_model_len`` is not a positive int.
        """
        length = _check_model_len(max_model_len)
        return min(
            cdiv(length, self.block_size), cdiv(self.sliding_window - 1, self.block_size) + 1
        )


@dataclass(frozen=True)
class MLAAttentionSpec(_AttentionSpec):
    """One multi-head latent attention (MLA) layer's KV cache block.

    MLA keeps one compressed latent vector per token (no separate K and V), e.g. DeepSeek-V3's
    512 + 64 (rope) = 576 elements, described as ``num_kv_heads=1, head_size=576``.

    Attributes:
        block_size: tokens per GPU block.
        num_kv_heads: latent "heads" per token (usually 1).
        head_size: elements per latent head.
        dtype: element type (a ``torch.dtype`` or a name such as ``"bf16"``).

    Raises:
        ValueError: when a size is not a positive int or the dtype name is unknown.
    """

    _KV_FACTOR: ClassVar[int] = 1


@dataclass(frozen=True)
class MambaSpec:
    """One Mamba (state-space) layer's state: a fixed-size state that occupies one block.

    Attributes:
        block_size: tokens per GPU block of the layer's group (the block table's granularity;
            the state does not grow with it).
        shapes: the state arrays' shapes (e.g. conv state, SSM state), each a tuple of positive
            ints; lists are accepted and converted.
        dtypes: the element type of each state array (``torch.dtype`` or names).
        page_size_padded: bytes the block occupies when the state is padded so that its page
            matches the attention page of a hybrid model; ``None`` means unpadded. Must be at
            least :attr:`page_size_unpadded`.

    Raises:
        ValueError: on an empty or non-positive shape, a shapes/dtypes length mismatch, an
            unknown dtype name, or ``page_size_padded`` below the unpadded size.
    """

    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        _check_positive_int("MambaSpec", "block_size", self.block_size)
        try:
            shapes = tuple(tuple(shape) for shape in self.shapes)
        except TypeError:
            raise ValueError(
                f"MambaSpec.shapes must be a sequence of shapes (tuples of ints), "
                f"got {self.shapes!r}"
            ) from None
        if not shapes:
            raise ValueError("MambaSpec.shapes is empty; give at least one state shape")
        for shape in shapes:
            if not shape or any(
                isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape
            ):
                raise ValueError(
                    f"MambaSpec.shapes: {shape!r} is not a shape of positive ints; "
                    "write e.g. (8192, 3)"
                )
        if isinstance(self.dtypes, (str, torch.dtype)):
            raise ValueError(
                f"MambaSpec.dtypes must be one dtype per shape (a tuple), got {self.dtypes!r}"
            )
        if not isinstance(self.dtypes, Iterable):
            raise ValueError(
                f"MambaSpec.dtypes must be one dtype per shape (a tuple), got {self.dtypes!r}"
            )
        dtypes = tuple(dtype_from_name(d) for d in self.dtypes)
        if len(dtypes) != len(shapes):
            raise ValueError(
                f"MambaSpec has {len(shapes)} shapes but {len(dtypes)} dtypes; give one dtype "
                "per state shape"
            )
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)
        if self.page_size_padded is not None:
            _check_positive_int("MambaSpec", "page_size_padded", self.page_size_padded)
            if self.page_size_padded < self.page_size_unpadded:
                raise ValueError(
                    f"MambaSpec.page_size_padded={self.page_size_padded} bytes is smaller than "
                    f"the state itself ({self.page_size_unpadded} bytes); pad to at least "
                    f"{self.page_size_unpadded} or leave it None"
                )

    @property
    def page_size_unpadded(self) -> int:
        """Bytes of the state: sum over arrays of prod(shape) × dtype size."""
        return sum(
            math.prod(shape) * dtype.itemsize
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer: ``page_size_padded`` when set, else the state's
        unpadded size."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.page_size_unpadded

    def max_num_blocks(self, max_model_len: int) -> int:
        """GPU blocks one request needs in this group: 1 (the state lives in one block, older
        states are null), whatever ``max_model_len`` is.

        Raises:
            ValueError: when ``max_model_len`` is not a positive int.
        """
        _check_model_len(max_model_len)
        return 1


_LAYER_SPEC_TYPES = (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec, MambaSpec)


class _FrozenMap(Mapping):
    """An immutable, hashable, insertion-ordered mapping (layer name → spec)."""

    __slots__ = ("_items", "_map")

    def __init__(self, items: Mapping[str, object]) -> None:
        self._items = tuple(items.items())
        self._map = dict(self._items)

    def __getitem__(self, key: str) -> object:
        return self._map[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        # equality ignores the order of the items (a dict's), so the hash must too
        return hash(frozenset(self._items))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self._items) == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return f"{{{', '.join(f'{k!r}: {v!r}' for k, v in self._items)}}}"


def _type_key(spec: object) -> tuple[object, ...]:
    """What must agree for layers to share one block table: class, block size, window."""
    return (type(spec), spec.block_size, getattr(spec, "sliding_window", None))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs:
    """One KV cache group whose layers share an attention type but differ in page size.

    All layers share the group's block table (so one block id indexes every layer), but each
    layer has its own page (e.g. different ``num_kv_heads`` or ``head_size`` per layer).

    Attributes:
        block_size: tokens per GPU block; every layer's ``block_size`` must equal it.
        kv_cache_specs: layer name → spec (all the same spec class; sliding-window layers must
            share one window). Stored as an immutable, hashable mapping (``dict(...)`` gives a
            plain dict back).

    Raises:
        ValueError: for an empty mapping, a non-spec or nested value, mixed spec classes or
            windows, or a layer whose ``block_size`` differs from ``block_size``.
    """

    block_size: int
    kv_cache_specs: Mapping[str, KVCacheSpec]

    def __post_init__(self) -> None:
        _check_positive_int("UniformTypeKVCacheSpecs", "block_size", self.block_size)
        if not isinstance(self.kv_cache_specs, Mapping) or not self.kv_cache_specs:
            raise ValueError(
                "UniformTypeKVCacheSpecs.kv_cache_specs must be a non-empty mapping "
                f"layer name → spec, got {self.kv_cache_specs!r}"
            )
        specs = _FrozenMap(self.kv_cache_specs)
        first_name, first = next(iter(specs.items()))
        for name, spec in specs.items():
            if not isinstance(name, str):
                raise ValueError(f"UniformTypeKVCacheSpecs: layer name {name!r} is not a string")
            if not isinstance(spec, _LAYER_SPEC_TYPES):
                raise ValueError(
                    f"UniformTypeKVCacheSpecs: layer {name!r} has {type(spec).__name__}; give "
                    "one layer spec per layer (FullAttentionSpec, SlidingWindowSpec, "
                    "MLAAttentionSpec or MambaSpec), not a nested group"
                )
            if spec.block_size != self.block_size:
                raise ValueError(
                    f"UniformTypeKVCacheSpecs: layer {name!r} has block_size={spec.block_size} "
                    f"but the group uses block_size={self.block_size}; all layers of one group "
                    "share one block table, so give them the same block_size"
                )
            if _type_key(spec) != _type_key(first):
                raise ValueError(
                    f"UniformTypeKVCacheSpecs mixes layer types: {first_name!r} is {first!r} "
                    f"but {name!r} is {spec!r}; put layers of different types (or sliding "
                    "windows) in different groups"
                )
        object.__setattr__(self, "kv_cache_specs", specs)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block id costs over all layers of the group: the sum of their pages."""
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_num_blocks(self, max_model_len: int) -> int:
        """GPU blocks one request of ``max_model_len`` tokens needs in this group: the maximum
        over its layers (they share the block table).

        Raises:
            ValueError: when ``max_model_len`` is not a positive int.
        """
        return max(spec.max_num_blocks(max_model_len) for spec in self.kv_cache_specs.values())


KVCacheSpec = (
    FullAttentionSpec | SlidingWindowSpec | MLAAttentionSpec | MambaSpec | UniformTypeKVCacheSpecs
)
"""Any KV cache spec: one layer's, or one group's with per-layer pages."""

_SPEC_TYPES = (*_LAYER_SPEC_TYPES, UniformTypeKVCacheSpecs)


@dataclass(frozen=True)
class KVCacheTensor:
    """One raw GPU allocation of the KV cache.

    Attributes:
        size: bytes of the allocation (0 allowed for an engine without blocks).
        shared_by: names of the layers that use it (lists are converted to tuples); layers of
            different groups may share one tensor (same bytes, different block ids).

    Raises:
        ValueError: for a negative size or one of 2**63 bytes or more, no layer, a non-string or
            repeated layer name.
    """

    size: int
    shared_by: tuple[str, ...]

    def __post_init__(self) -> None:
        _check_non_negative_int("KVCacheTensor", "size", self.size)
        names = _layer_names(self.shared_by)
        if not names or not all(isinstance(n, str) for n in names):
            raise ValueError(
                f"KVCacheTensor.shared_by must name at least one layer (strings), got "
                f"{self.shared_by!r}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"KVCacheTensor.shared_by repeats a layer: {names!r}")
        object.__setattr__(self, "shared_by", names)


def _layer_names(value: object) -> tuple[object, ...]:
    """Layer names as a tuple (one str is one name); ``()`` for a value that is not a
    collection (None), which the callers refuse naming the field."""
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, Iterable) else ()


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group: layers that share one block table.

    Attributes:
        layer_names: the group's layers (a list is converted to a tuple).
        kv_cache_spec: the group's spec; a :class:`UniformTypeKVCacheSpecs` must name exactly
            the group's layers.

    Raises:
        ValueError: for no layers, repeated names, a non-spec, or a
            :class:`UniformTypeKVCacheSpecs` whose layers differ from ``layer_names``.
    """

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        names = _layer_names(self.layer_names)
        if not names or not all(isinstance(n, str) for n in names):
            raise ValueError(
                f"KVCacheGroupSpec.layer_names must name at least one layer (strings), got "
                f"{self.layer_names!r}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"KVCacheGroupSpec.layer_names repeats a layer: {names!r}")
        if not isinstance(self.kv_cache_spec, _SPEC_TYPES):
            raise ValueError(
                f"KVCacheGroupSpec.kv_cache_spec must be a KV cache spec, got "
                f"{type(self.kv_cache_spec).__name__}"
            )
        if isinstance(self.kv_cache_spec, UniformTypeKVCacheSpecs) and set(names) != set(
            self.kv_cache_spec.kv_cache_specs
        ):
            raise ValueError(
                f"KVCacheGroupSpec: layer_names {names!r} differ from the layers of its "
                f"UniformTypeKVCacheSpecs {tuple(self.kv_cache_spec.kv_cache_specs)!r}"
            )
        object.__setattr__(self, "layer_names", names)


def _layer_page(group: KVCacheGroupSpec, layer: str) -> int:
    """Bytes of one GPU block of ``layer`` (its own spec inside a UniformTypeKVCacheSpecs)."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer].page_size_bytes
    return spec.page_size_bytes


@dataclass(frozen=True)
class KVCacheConfig:
    """The engine's GPU cache plan (docs/design.md): blocks, raw tensors and groups.

    Attributes:
        num_blocks: GPU blocks (block ids ``0 .. num_blocks - 1``; 0 is the null block).
            Authoritative: never infer it from a tensor's shape (invariant 2).
        kv_cache_tensors: the raw allocations (a list is converted to a tuple).
        kv_cache_groups: the groups, in group-index order (a list is converted to a tuple).
        max_model_len: the longest request (tokens) the plan admits; ``None`` when the plan
            was built by hand without one (:func:`kvoff.get_kv_cache_config` always sets it).

    Raises:
        ValueError: for a negative ``num_blocks``, non-positive ``max_model_len``, either of
            them (or a tensor ``size``) 2**63 or more (the C++ core's int64), elements of
            the wrong type, a layer in two groups or two tensors, a tensor naming a layer of
            no group, a group layer in no tensor while ``num_blocks > 0``, or a tensor smaller
            than ``num_blocks`` pages of one of its layers.
    """

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _check_non_negative_int("KVCacheConfig", "num_blocks", self.num_blocks)
        if self.max_model_len is not None:
            _check_positive_int("KVCacheConfig", "max_model_len", self.max_model_len)
        tensors = tuple(self.kv_cache_tensors)
        groups = tuple(self.kv_cache_groups)
        if not all(isinstance(t, KVCacheTensor) for t in tensors):
            raise ValueError("KVCacheConfig.kv_cache_tensors must hold KVCacheTensor objects")
        if not groups or not all(isinstance(g, KVCacheGroupSpec) for g in groups):
            raise ValueError(
                "KVCacheConfig.kv_cache_groups must hold at least one KVCacheGroupSpec"
            )
        seen: dict[str, int] = {}
        for index, group in enumerate(groups):
            for name in group.layer_names:
                if name in seen:
                    raise ValueError(
                        f"KVCacheConfig: layer {name!r} is in groups {seen[name]} and {index}; "
                        "each layer belongs to exactly one group"
                    )
                seen[name] = index
        in_tensor: set[str] = set()
        for tensor in tensors:
            for name in tensor.shared_by:
                if name not in seen:
                    raise ValueError(
                        f"KVCacheConfig: tensor shared_by names layer {name!r}, which is in no "
                        "group; add it to a KVCacheGroupSpec or drop it from the tensor"
                    )
                if name in in_tensor:
                    raise ValueError(
                        f"KVCacheConfig: layer {name!r} appears in two KVCacheTensors; each "
                        "layer uses exactly one tensor"
                    )
                in_tensor.add(name)
        if self.num_blocks > 0:
            # bytes per GPU block is total tensor bytes // num_blocks (invariant 3): a layer with
            # no tensor would be left out of it and the CPU pool would be sized too large
            missing = [n for g in groups for n in g.layer_names if n not in in_tensor]
            if missing:
                raise ValueError(
                    f"KVCacheConfig: layer {missing[0]!r} is in a KV cache group but in no "
                    f"KVCacheTensor (layers without a tensor: {missing}); with num_blocks="
                    f"{self.num_blocks} every group layer needs a tensor: name it in the "
                    "shared_by of a KVCacheTensor of at least num_blocks x page_size_bytes"
                )
        for tensor in tensors:
            # every layer needs num_blocks pages inside its tensor: a smaller tensor would make
            # the CPU pool's block size (tensor bytes // num_blocks) smaller than a real block
            need = self.num_blocks * max(
                (_layer_page(groups[seen[n]], n) for n in tensor.shared_by), default=0
            )
            if tensor.size < need:
                raise ValueError(
                    f"KVCacheConfig: the tensor of {list(tensor.shared_by)} has size="
                    f"{tensor.size} bytes, less than num_blocks ({self.num_blocks}) pages of its "
                    f"layers ({need} bytes); give each tensor at least num_blocks x page_size_bytes"
                )
        object.__setattr__(self, "kv_cache_tensors", tensors)
        object.__setattr__(self, "kv_cache_groups", groups)

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors together (one rank)."""
        return sum(t.size for t in self.kv_cache_tensors)

    def layer_to_group(self) -> dict[str, int]:
        """Layer name → index of its group."""
        return {n: i for i, g in enumerate(self.kv_cache_groups) for n in g.layer_names}
