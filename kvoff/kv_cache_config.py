"""The GPU cache plan: group layers, build the raw tensors and count the GPU blocks.

:func:`get_kv_cache_config` turns one spec per layer and a memory budget into a
:class:`kvoff.specs.KVCacheConfig`; :func:`pool_bytes_per_block` is the divisor that turns
memory into ``num_blocks``. docs/design.md invariants 2 (``num_blocks`` is authoritative) and 5
(``num_gpu_blocks_override`` sets capacity before anything else looks at it).

Grouping (the idea follows vLLM's ``kv_cache_utils``; the code is kvoff's own):

* every layer has the same spec → one group, one tensor per layer;
* one layer type and block size but different page sizes → one group whose spec is a
  :class:`~kvoff.specs.UniformTypeKVCacheSpecs`, one tensor per layer (``page_l × num_blocks``);
* hybrid (several types, e.g. full + sliding window, attention + Mamba) → layers with equal
  specs form a *kind*; ``group_size`` = the fewest layers of any kind; each kind is cut into
  groups of ``group_size`` layers (the last group of a kind may be smaller); ``group_size``
  tensors are built, tensor ``i`` shared by the ``i``-th layer of every group. All hybrid specs
  must then have the same page size, since one tensor serves layers of several kinds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvoff.sizing import bytes_per_gpu_block
from kvoff.specs import (
    INT64_LIMIT,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    _type_key,
)

__all__ = ["fit_max_model_len", "get_kv_cache_config", "pool_bytes_per_block"]

_LAYER_SPECS = (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec, MambaSpec)


def _check_arg(name: str, value: object, what: str) -> None:
    """Refuse ``value`` unless it is an int (not a bool) in ``1 .. 2**63 - 1``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int ({what}), got {value!r}")
    if value >= INT64_LIMIT:
        raise ValueError(
            f"{name}={value} is too large: the C++ core takes int64, so use a value below 2**63"
        )


def pool_bytes_per_block(kv_cache_groups: Sequence[KVCacheGroupSpec]) -> int:
    """Bytes one block id costs in the shared GPU pool (one rank) for these groups.

    * one group: the sum of its layers' pages (``page × layers``, or a
      :class:`~kvoff.specs.UniformTypeKVCacheSpecs` page, which already sums its layers);
    * several groups sharing tensors position by position (hybrid): ``page × group_size``, with
      ``group_size`` the most layers of any group (= the number of shared tensors).

    For every plan :func:`get_kv_cache_config` produces this equals
    ``sum(tensor sizes) // num_blocks`` (:func:`kvoff.sizing.bytes_per_gpu_block`, which computes
    it here from one block of each tensor).

    Raises:
        ValueError: for no groups, or several groups whose page sizes differ (they cannot share
            tensors).
    """
    groups = tuple(kv_cache_groups)
    if not groups:
        raise ValueError("pool_bytes_per_block needs at least one KVCacheGroupSpec, got none")
    if len(groups) == 1:
        group = groups[0]
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return bytes_per_gpu_block([spec.page_size_bytes], 1)  # the page sums its layers
        return bytes_per_gpu_block([spec.page_size_bytes] * len(group.layer_names), 1)
    pages = {g.kv_cache_spec.page_size_bytes for g in groups}
    if len(pages) != 1 or any(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in groups):
        raise ValueError(
            "groups that share tensors need one page size per layer, got page sizes "
            f"{[g.kv_cache_spec.page_size_bytes for g in groups]} bytes"
        )
    # one tensor per position, shared by the groups: as many as the largest group has layers
    return bytes_per_gpu_block([pages.pop()] * max(len(g.layer_names) for g in groups), 1)


def _blocks_needed(groups: Sequence[KVCacheGroupSpec], max_model_len: int) -> int:
    """GPU blocks one request of ``max_model_len`` tokens needs over all groups."""
    return sum(g.kv_cache_spec.max_num_blocks(max_model_len) for g in groups)


def fit_max_model_len(kv_cache_groups: Sequence[KVCacheGroupSpec], num_blocks: int) -> int:
    """The longest request (tokens) whose blocks fit in ``num_blocks - 1`` usable blocks.

    One request of ``L`` tokens needs ``sum over groups of max_num_blocks(L)`` blocks; block 0
    is the null block and is kept in reserve. The need grows with ``L``, so a binary search
    finds the largest fitting ``L``. Groups without full attention (only sliding windows or
    Mamba) need a bounded number of blocks, so the search is capped at ``(num_blocks - 1) ×
    the largest block size`` tokens, which is also the cap a full-attention group would have
    (and at 2**63 - 1 tokens, the C++ core's int64).

    Args:
        kv_cache_groups: the plan's groups (at least one :class:`~kvoff.specs.KVCacheGroupSpec`).
        num_blocks: GPU blocks of the plan, block 0 (the null block) included: an int >= 0.

    Returns:
        the fitting length in tokens, or 0 when not even one token fits.

    Raises:
        ValueError: for no groups, an element that is not a ``KVCacheGroupSpec``, or a
            ``num_blocks`` that is not an int >= 0 (a bool or a float is refused).
    """
    groups = tuple(kv_cache_groups)
    if not groups or not all(isinstance(g, KVCacheGroupSpec) for g in groups):
        raise ValueError(
            f"kv_cache_groups must hold at least one KVCacheGroupSpec, got {kv_cache_groups!r}"
        )
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError(
            f"num_blocks must be an int >= 0 (GPU blocks, the null block included), got "
            f"{num_blocks!r}"
        )
    usable = num_blocks - 1
    if usable < 1 or _blocks_needed(groups, 1) > usable:
        return 0
    lo = 1
    hi = min(usable * max(g.kv_cache_spec.block_size for g in groups), INT64_LIMIT - 1)
    if _blocks_needed(groups, hi) <= usable:
        return hi
    # invariant: need(lo) fits, need(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _blocks_needed(groups, mid) <= usable:
            lo = mid
        else:
            hi = mid
    return lo


def _group_layers(
    kv_cache_specs: Mapping[str, KVCacheSpec],
) -> tuple[tuple[KVCacheGroupSpec, ...], list[tuple[int, tuple[str, ...]]]]:
    """Groups, and the tensors as (page bytes per block, shared_by) pairs."""
    items = list(kv_cache_specs.items())
    specs = [spec for _, spec in items]
    if all(spec == specs[0] for spec in specs):
        names = tuple(name for name, _ in items)
        group = KVCacheGroupSpec(names, specs[0])
        return (group,), [(specs[0].page_size_bytes, (name,)) for name in names]
    if len({_type_key(spec) for spec in specs}) == 1:
        uniform = UniformTypeKVCacheSpecs(specs[0].block_size, dict(items))
        group = KVCacheGroupSpec(tuple(name for name, _ in items), uniform)
        return (group,), [(spec.page_size_bytes, (name,)) for name, spec in items]
    # hybrid: kinds of equal specs, in order of first appearance
    kinds: dict[KVCacheSpec, list[str]] = {}
    for name, spec in items:
        kinds.setdefault(spec, []).append(name)
    pages = {spec.page_size_bytes for spec in kinds}
    if len(pages) != 1:
        detail = "; ".join(
            f"{spec!r} ({len(names)} layers, e.g. {names[0]!r}): {spec.page_size_bytes} bytes"
            for spec, names in kinds.items()
        )
        raise ValueError(
            "a hybrid model's layer kinds must share one page size, because layers of different "
            f"groups share GPU tensors; got {detail}. Pad the Mamba page (MambaSpec."
            "page_size_padded) or choose block sizes so that every kind's page_size_bytes matches"
        )
    page = pages.pop()
    group_size = min(len(names) for names in kinds.values())
    groups = []
    for spec, names in kinds.items():
        for start in range(0, len(names), group_size):
            groups.append(KVCacheGroupSpec(tuple(names[start : start + group_size]), spec))
    tensors = [
        (page, tuple(g.layer_names[i] for g in groups if i < len(g.layer_names)))
        for i in range(group_size)
    ]
    return tuple(groups), tensors


def get_kv_cache_config(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    *,
    max_model_len: int | None = None,
    num_gpu_blocks_override: int | None = None,
) -> KVCacheConfig:
    """Plan the GPU KV cache of one rank: groups, tensors, ``num_blocks`` and max model length.

    Args:
        kv_cache_specs: layer name → that layer's spec (FullAttentionSpec, SlidingWindowSpec,
            MLAAttentionSpec or MambaSpec), in layer order.
        available_memory: bytes of GPU memory for the KV cache (one rank).
        max_model_len: the longest request in tokens that must fit; ``None`` auto-fits the
            largest length one request can use.
        num_gpu_blocks_override: when given, ``num_blocks`` = this value and the capacity is
            ``override × pool_bytes_per_block(groups)`` bytes, decided before the length is
            fitted (invariant 5). It is honoured even when that exceeds ``available_memory``
            (that is what an override means; the engine must then find the memory).

    Returns:
        a :class:`~kvoff.specs.KVCacheConfig` whose tensors total ``num_blocks ×
        pool_bytes_per_block(groups)`` bytes and whose ``max_model_len`` is the resolved length.

    Raises:
        ValueError: for empty specs, a non-spec value, memory / override / length that is not
            a positive int below 2**63 (the C++ core's int64), an override whose tensors would
            total 2**63 bytes or more, hybrid kinds with different page sizes, and when not
            even one token — or a
            given ``max_model_len`` — fits (the message names the length, the blocks needed,
            the blocks available and what to change).
    """
    if not isinstance(kv_cache_specs, Mapping) or not kv_cache_specs:
        raise ValueError(
            f"kv_cache_specs must be a non-empty mapping layer name → spec, got {kv_cache_specs!r}"
        )
    for name, spec in kv_cache_specs.items():
        if not isinstance(name, str):
            raise ValueError(f"layer name {name!r} is not a string")
        if not isinstance(spec, _LAYER_SPECS):
            raise ValueError(
                f"layer {name!r}: {type(spec).__name__} is not a layer spec; give one "
                "FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec or MambaSpec per layer"
            )
    _check_arg("available_memory", available_memory, "bytes")
    if num_gpu_blocks_override is not None:
        _check_arg("num_gpu_blocks_override", num_gpu_blocks_override, "GPU blocks")
    if max_model_len is not None:
        _check_arg("max_model_len", max_model_len, "tokens")

    groups, tensor_plan = _group_layers(kv_cache_specs)
    per_block = pool_bytes_per_block(groups)
    # invariant 5: the override decides capacity before anything looks at it
    if num_gpu_blocks_override is not None:
        num_blocks = num_gpu_blocks_override
        if num_blocks * per_block >= INT64_LIMIT:  # available_memory < 2**63 bounds the other way
            raise ValueError(
                f"num_gpu_blocks_override={num_blocks} blocks x {per_block} bytes per block is "
                "2**63 bytes or more, beyond the C++ core's int64; use num_gpu_blocks_override "
                f"<= {(INT64_LIMIT - 1) // per_block}"
            )
        source = f"num_gpu_blocks_override={num_gpu_blocks_override}"
        fix = "raise num_gpu_blocks_override"
    else:
        num_blocks = available_memory // per_block
        source = f"available_memory={available_memory} bytes // {per_block} bytes per block"
        fix = "give more GPU memory"

    fitting = fit_max_model_len(groups, num_blocks)
    if fitting == 0:
        need = _blocks_needed(groups, 1)
        raise ValueError(
            f"not even one token fits: one request needs {need} blocks (one per group) plus the "
            f"reserved null block, but there are {num_blocks} blocks ({source}); {fix} to at "
            f"least {need + 1} blocks ({(need + 1) * per_block} bytes)"
        )
    if max_model_len is None:
        resolved = fitting
    else:
        need = _blocks_needed(groups, max_model_len)
        if need > num_blocks - 1:
            raise ValueError(
                f"max_model_len={max_model_len} tokens does not fit: one request needs {need} "
                f"blocks, but only {num_blocks - 1} are usable ({num_blocks} blocks from "
                f"{source}, minus the reserved null block); {fix} to at least {need + 1} blocks "
                f"({(need + 1) * per_block} bytes), or use max_model_len <= {fitting}"
            )
        resolved = max_model_len

    tensors = tuple(KVCacheTensor(page * num_blocks, names) for page, names in tensor_plan)
    return KVCacheConfig(num_blocks, tensors, groups, resolved)
