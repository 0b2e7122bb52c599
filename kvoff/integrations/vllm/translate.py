"""vLLM's configuration in kvoff's terms: vLLM's KV cache specs and plan as kvoff's
(:func:`kvoff_kv_cache_config`), ``kv_connector_extra_config`` as a
:class:`kvoff.OffloadingConfig` (:func:`offloading_config`), and both as the
:class:`kvoff.CPUOffloadingSpec` of :class:`~kvoff.integrations.vllm.KvoffConnector`
(:func:`cpu_spec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvoff import specs as kspecs
from kvoff.config import EVICTION_POLICIES, ConfigError, OffloadingConfig
from kvoff.offloading_spec import CPUOffloadingSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig as VllmKVCacheConfig

__all__ = [
    "VLLM_SPEC_KEYS",
    "cpu_spec",
    "kvoff_kv_cache_config",
    "offloading_config",
    "require_bytes",
]

VLLM_SPEC_KEYS: frozenset[str] = frozenset(
    {"spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "offload_prompt_only",
     "self_describing_kv_events", "canonical_layout", "kv_load_tiers"}
)  # fmt: skip
"""``kv_connector_extra_config`` keys that vLLM's ``OffloadingConnector`` reads itself; the
spec path passes them by and validates the rest as a :class:`kvoff.OffloadingConfig`."""


def _kvoff_spec(spec: object, layer: str | None = None) -> kspecs.KVCacheSpec:
    """kvoff's spec for one vLLM KV cache spec.

    Raises:
        ValueError: for a spec kvoff cannot offload (naming it).
    """
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return kspecs.UniformTypeKVCacheSpecs(
            spec.block_size,
            {name: _kvoff_spec(s, name) for name, s in spec.kv_cache_specs.items()},
        )
    if isinstance(spec, MambaSpec):
        return kspecs.MambaSpec(
            spec.block_size, tuple(map(tuple, spec.shapes)), tuple(spec.dtypes),
            spec.page_size_padded,
        )  # fmt: skip
    if isinstance(spec, MLAAttentionSpec):
        return kspecs.MLAAttentionSpec(
            spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype
        )
    if isinstance(spec, SlidingWindowSpec):
        return kspecs.SlidingWindowSpec(
            spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype, spec.sliding_window
        )
    if isinstance(spec, FullAttentionSpec) and not isinstance(spec, ChunkedLocalAttentionSpec):
        if spec.head_size_v != spec.head_size:
            raise ValueError(
                f"layer {layer!r}: K and V head sizes differ ({spec.head_size} vs "
                f"{spec.head_size_v}); kvoff offloads attention KV with equal K and V sizes"
            )
        if spec.sliding_window is not None:  # a full-attention group that records a window
            return kspecs.SlidingWindowSpec(
                spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype,
                spec.sliding_window,
            )  # fmt: skip
        return kspecs.FullAttentionSpec(
            spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype
        )
    raise ValueError(
        f"layer {layer!r}: kvoff cannot offload a {type(spec).__name__} KV cache group; it "
        "offloads full attention, sliding window, MLA and Mamba groups"
    )


def kvoff_kv_cache_config(config: VllmKVCacheConfig) -> kspecs.KVCacheConfig:
    """kvoff's :class:`kvoff.KVCacheConfig` for vLLM's.

    ``num_blocks`` is vLLM's (authoritative, docs/design.md invariant 2). In vLLM 0.32 every
    ``KVCacheTensor`` places its layers in ONE backing allocation of ``size`` bytes (groups
    overlay each other), so the translation has one tensor of that size shared by every layer:
    bytes per GPU block = ``size // num_blocks`` (docs/design.md invariant 3), not the sum over the
    entries, each of which states the whole allocation's size.

    Raises:
        ValueError: for a group kvoff cannot offload, or tensors of different backing sizes.
    """
    groups = tuple(
        kspecs.KVCacheGroupSpec(tuple(g.layer_names), _kvoff_spec(g.kv_cache_spec))
        for g in config.kv_cache_groups
    )
    sizes = {t.size for t in config.kv_cache_tensors}
    if len(sizes) > 1:
        raise ValueError(
            f"vLLM's KV cache tensors state backing sizes {sorted(sizes)}; kvoff expects the one "
            "shared allocation of vLLM 0.32 (KVCacheTensor.size)"
        )
    layers = tuple(name for g in groups for name in g.layer_names)
    tensors = (kspecs.KVCacheTensor(sizes.pop(), layers),) if sizes else ()
    return kspecs.KVCacheConfig(config.num_blocks, tensors, groups)


def offloading_config(extra: Mapping[str, Any], *, spec_path: bool) -> OffloadingConfig:
    """The :class:`kvoff.OffloadingConfig` in ``kv_connector_extra_config``.

    vLLM's CPU offloading keys carry over: ``eviction_policy``, ``store_threshold`` and
    ``max_tracker_size`` are kvoff keys of the same meaning, and ``cache_policy_module_path``
    is accepted when empty.

    Raises:
        kvoff.config.ConfigError: for an unknown key (naming it and the closest valid key), a
            missing ``cpu_bytes_to_use`` (vLLM's message: "cpu_bytes_to_use must be
            specified"), a ``cache_policy_module_path`` (a Python policy cannot run in kvoff's
            C++ manager), or on the spec path a key vLLM's OffloadingConnector decides itself
            (``offloaded_block_size``, ``hash_block_size``, ``world_size``,
            ``store_batch_blocks``, ``offload_prompt_only`` is vLLM's own key there).
        pydantic.ValidationError: for a bad value (naming it).
    """
    data = {k: v for k, v in dict(extra).items() if not (spec_path and k in VLLM_SPEC_KEYS)}
    module = data.pop("cache_policy_module_path", None)
    if module:
        raise ConfigError(
            f"kv_connector_extra_config cache_policy_module_path={module!r}: kvoff's eviction "
            "policies run inside its C++ manager, which cannot call a Python CachePolicy; "
            f"choose eviction_policy from {list(EVICTION_POLICIES)} and remove the key, or use "
            "vLLM's own CPUOffloadingSpec for a Python policy"
        )
    sized = data.get("cpu_bytes_to_use") or "num_cpu_blocks" in data
    if data.get("node_pool") is None and not sized:
        # an unknown key first (a misspelt cpu_bytes_to_use is named with the fix)
        OffloadingConfig.from_dict({**data, "cpu_bytes_to_use": 1})
        raise ConfigError(
            "cpu_bytes_to_use must be specified in kv_connector_extra_config: the CPU pool's "
            'bytes over all ranks, e.g. "cpu_bytes_to_use": "40GiB"'
        )
    ignored = {
        "offloaded_block_size": "block_size (vLLM's key: tokens per offloaded block)",
        "hash_block_size": "nothing (vLLM hashes with its own block size)",
        "world_size": "nothing (vLLM sets the ranks)",
        "store_batch_blocks": "KvoffConnector (vLLM's scheduler stores every block as it fills)",
    }
    unused = sorted(ignored.keys() & data.keys()) if spec_path else []
    if unused:
        key = unused[0]
        raise ConfigError(
            f"kv_connector_extra_config key {key!r} is not used by KvoffOffloadingSpec (vLLM's "
            f"OffloadingConnector decides it itself); use {ignored[key]}"
        )
    if spec_path and "block_size" in extra and "offloaded_block_size" not in data:
        data["offloaded_block_size"] = int(extra["block_size"])
    return OffloadingConfig.from_dict(data)


def cpu_spec(
    vllm_config: VllmConfig,
    kv_cache_config: VllmKVCacheConfig,
    config: OffloadingConfig,
    cpu_bytes_to_use: int | None = None,
) -> CPUOffloadingSpec:
    """The :class:`kvoff.CPUOffloadingSpec` of ``KvoffConnector``: vLLM's KV cache plan
    (:func:`kvoff_kv_cache_config`), the engine's ranks and hash block size (tokens), and
    ``config``'s pool bytes (or ``cpu_bytes_to_use``: a node pool's, over all ranks),
    offloaded block size (tokens) and eviction policy.

    Raises:
        ValueError: ``world_size`` or ``hash_block_size`` in ``config`` that disagree with the
            engine, no ``cpu_bytes_to_use`` (:func:`require_bytes`), and what
            :func:`kvoff_kv_cache_config` and :class:`kvoff.CPUOffloadingSpec` raise.
    """
    kvoff_config = kvoff_kv_cache_config(kv_cache_config)
    world = vllm_config.parallel_config.world_size
    if config.world_size not in (1, world):
        raise ValueError(
            f"kv_connector_extra_config world_size={config.world_size} disagrees with the "
            f"engine's {world} ranks; leave world_size out (vLLM sets it)"
        )
    hash_bs = kv_cache_config.hash_block_size or vllm_config.cache_config.block_size
    if config.hash_block_size not in (None, hash_bs):
        raise ValueError(
            f"kv_connector_extra_config hash_block_size={config.hash_block_size} disagrees with "
            f"the engine, which hashes every {hash_bs} tokens; leave hash_block_size out (vLLM "
            "sets it)"
        )
    return CPUOffloadingSpec(
        kvoff_config,
        cpu_bytes_to_use=require_bytes(config) if cpu_bytes_to_use is None else cpu_bytes_to_use,
        block_size=config.offloaded_block_size,
        hash_block_size=hash_bs,
        world_size=world,
        eviction_policy=config.eviction_policy,
    )


def require_bytes(config: OffloadingConfig) -> int:
    """``config.cpu_bytes_to_use``: the CPU pool's bytes over all ranks.

    Raises:
        ValueError: the pool is sized by ``num_cpu_blocks`` instead (vLLM decides the bytes
            per block, so a block count cannot size it).
    """
    if config.cpu_bytes_to_use is None:
        raise ValueError(
            "kv_connector_extra_config needs cpu_bytes_to_use (bytes over all ranks, e.g. "
            '"40GiB"); num_cpu_blocks cannot size a pool whose block bytes vLLM decides'
        )
    return config.cpu_bytes_to_use
