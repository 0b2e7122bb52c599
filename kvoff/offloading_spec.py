"""The CPU plan: offloaded block size and CPU pool slots for one :class:`KVCacheConfig`.

docs/design.md invariant 3: the CPU slot count is computed only by
:func:`kvoff.sizing.compute_num_cpu_blocks`, from ``kv_bytes_per_block`` = total bytes of the
config's tensors // its ``num_blocks`` (bytes per GPU block over all layers of one rank:
:func:`kvoff.sizing.bytes_per_gpu_block`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from kvoff.config import EVICTION_POLICIES, OffloadingConfig
from kvoff.sizing import bytes_per_gpu_block, compute_num_cpu_blocks
from kvoff.specs import KVCacheConfig

__all__ = ["CPUOffloadingSpec"]

_EXTRA_CONFIG_KEYS = ("cpu_bytes_to_use", "block_size", "hash_block_size", "eviction_policy")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CPUOffloadingSpec:
    """The CPU offloading plan of one engine (the same object for the scheduler and every rank).

    Args:
        kv_cache_config: the engine's GPU plan (per rank).
        cpu_bytes_to_use: bytes of CPU memory for the pool, summed over all ``world_size``
            ranks (required, positive).
        block_size: tokens per offloaded block; ``None`` = the groups' common GPU block size.
            Must be a multiple of every group's GPU block size.
        hash_block_size: tokens per prefix-cache hash block; every GPU block size must be a
            multiple of it. ``None`` skips the check.
        world_size: tensor-parallel ranks (each keeps its shard of every slot).
        eviction_policy: one of :data:`kvoff.config.EVICTION_POLICIES`.

    Attributes (derived, read-only):
        gpu_block_size: tokens per GPU block, one entry per KV cache group.
        block_size_factor: GPU blocks per offloaded block.
        offloaded_block_size: tokens per offloaded block.
        kv_bytes_per_block: bytes of one GPU block over all layers of one rank:
            ``sum(tensor sizes) // kv_cache_config.num_blocks`` (0 without GPU blocks).
        num_blocks: CPU slots, ``compute_num_cpu_blocks(cpu_bytes_to_use, kv_bytes_per_block,
            block_size_factor, world_size)``; 0 when there are no GPU blocks.

    Raises:
        ValueError: each naming the values and the fix — missing or non-positive
            ``cpu_bytes_to_use``; a pool too small for one offloaded block; groups with
            different GPU block sizes; an offloaded size that is not a multiple of the GPU
            block size; a GPU block size not a multiple of ``hash_block_size``; an unknown
            eviction policy; ``world_size < 1``.
    """

    kv_cache_config: KVCacheConfig
    _: KW_ONLY
    cpu_bytes_to_use: int | None = None
    block_size: int | None = None
    hash_block_size: int | None = None
    world_size: int = 1
    eviction_policy: str = "lru"
    gpu_block_size: tuple[int, ...] = field(init=False)
    block_size_factor: int = field(init=False)
    offloaded_block_size: int = field(init=False)
    kv_bytes_per_block: int = field(init=False)
    num_blocks: int = field(init=False)

    def __post_init__(self) -> None:
        config = self.kv_cache_config
        if not isinstance(config, KVCacheConfig):
            raise ValueError(
                f"kv_cache_config must be a kvoff.KVCacheConfig, got {type(config).__name__}"
            )
        if self.cpu_bytes_to_use is None:
            raise ValueError(
                "cpu_bytes_to_use is missing: give the CPU pool size in bytes (summed over all "
                "ranks), e.g. cpu_bytes_to_use=64 * 2**30"
            )
        if not _is_int(self.cpu_bytes_to_use) or self.cpu_bytes_to_use <= 0:
            raise ValueError(
                f"cpu_bytes_to_use must be a positive number of bytes, got "
                f"{self.cpu_bytes_to_use!r}"
            )
        if not _is_int(self.world_size) or self.world_size < 1:
            raise ValueError(
                f"world_size must be an int >= 1 (tensor-parallel ranks), got {self.world_size!r}"
            )
        policy = self.eviction_policy
        name = policy.strip().lower() if isinstance(policy, str) else policy
        if name not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction_policy {policy!r}; choose one of {list(EVICTION_POLICIES)}"
            )
        object.__setattr__(self, "eviction_policy", name)

        gpu_block_size = tuple(g.kv_cache_spec.block_size for g in config.kv_cache_groups)
        sizes = sorted(set(gpu_block_size))
        if len(sizes) > 1:
            if self.block_size is not None:
                raise ValueError(
                    f"the KV cache groups have different GPU block sizes {list(gpu_block_size)} "
                    f"tokens, so a custom block_size={self.block_size} cannot be a whole number "
                    "of blocks of each group's table in step; give every group the same GPU "
                    "block size"
                )
            raise ValueError(
                f"the KV cache groups have different GPU block sizes {list(gpu_block_size)} "
                "tokens; offloading each group with its own block size is not supported: "
                "hybrid models must use one block size for every group (e.g. "
                f"{max(sizes)} tokens)"
            )
        gpu_bs = sizes[0]
        if self.hash_block_size is not None:
            if not _is_int(self.hash_block_size) or self.hash_block_size <= 0:
                raise ValueError(
                    f"hash_block_size must be a positive number of tokens, got "
                    f"{self.hash_block_size!r}"
                )
            if gpu_bs % self.hash_block_size:
                raise ValueError(
                    f"GPU block size {gpu_bs} tokens is not a multiple of hash_block_size="
                    f"{self.hash_block_size} tokens; hybrid models need block sizes aligned to "
                    "the prefix-cache hash size (choose a GPU block size that is a multiple of "
                    f"{self.hash_block_size})"
                )
        offloaded = gpu_bs if self.block_size is None else self.block_size
        if not _is_int(offloaded) or offloaded <= 0:
            raise ValueError(
                f"block_size (offloaded) must be a positive number of tokens, got {offloaded!r}"
            )
        if offloaded % gpu_bs:
            lower = max(1, offloaded // gpu_bs) * gpu_bs
            raise ValueError(
                f"offloaded block_size={offloaded} tokens is not a multiple of the GPU block "
                f"size {gpu_bs} tokens; use a multiple such as {lower} or {lower + gpu_bs}"
            )
        factor = offloaded // gpu_bs
        kv_bytes = bytes_per_gpu_block((t.size for t in config.kv_cache_tensors), config.num_blocks)
        num_blocks = compute_num_cpu_blocks(
            self.cpu_bytes_to_use, kv_bytes, factor, self.world_size
        )
        if num_blocks == 0 and kv_bytes > 0:
            need = kv_bytes * factor * self.world_size
            raise ValueError(
                f"cpu_bytes_to_use={self.cpu_bytes_to_use} bytes cannot hold one offloaded "
                f"block: one needs {need} bytes ({kv_bytes} bytes per GPU block × "
                f"block_size_factor {factor} × world_size {self.world_size}); raise "
                f"cpu_bytes_to_use to at least {need} or use a smaller block_size"
            )
        object.__setattr__(self, "gpu_block_size", gpu_block_size)
        object.__setattr__(self, "block_size_factor", factor)
        object.__setattr__(self, "offloaded_block_size", offloaded)
        object.__setattr__(self, "kv_bytes_per_block", kv_bytes)
        object.__setattr__(self, "num_blocks", num_blocks)

    @property
    def bytes_per_offloaded_block(self) -> int:
        """Bytes of one CPU slot on one rank (``kv_bytes_per_block × block_size_factor``)."""
        return self.kv_bytes_per_block * self.block_size_factor

    @property
    def num_tokens(self) -> int:
        """Tokens the CPU pool holds (``num_blocks × offloaded_block_size``)."""
        return self.num_blocks * self.offloaded_block_size

    @classmethod
    def from_dict(
        cls,
        kv_cache_config: KVCacheConfig,
        extra_config: Mapping[str, Any],
        world_size: int = 1,
    ) -> CPUOffloadingSpec:
        """Build the plan from engine-style configuration keys.

        Args:
            kv_cache_config: the engine's GPU plan.
            extra_config: keys ``cpu_bytes_to_use`` (bytes, required), ``block_size``
                (offloaded tokens), ``hash_block_size`` (tokens), ``eviction_policy``.
            world_size: tensor-parallel ranks.

        Raises:
            ValueError: for a key that is not one of those (the closest valid key is
                suggested), and everything the constructor raises.
        """
        if not isinstance(extra_config, Mapping):
            raise ValueError(
                f"extra_config must be a mapping of {list(_EXTRA_CONFIG_KEYS)}, got "
                f"{type(extra_config).__name__}"
            )
        for key in extra_config:
            if key not in _EXTRA_CONFIG_KEYS:
                close = difflib.get_close_matches(str(key), _EXTRA_CONFIG_KEYS, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(
                    f"unknown offloading config key {key!r}; {hint}valid keys are "
                    f"{list(_EXTRA_CONFIG_KEYS)}"
                )
        return cls(kv_cache_config, world_size=world_size, **dict(extra_config))

    @classmethod
    def from_config(
        cls, kv_cache_config: KVCacheConfig, config: OffloadingConfig
    ) -> CPUOffloadingSpec:
        """Build the plan from the library's configuration object (see
        :meth:`kvoff.OffloadingConfig.load`: dict, file, ``KVOFF_*`` environment, CLI).

        Uses ``cpu_bytes_to_use``, ``offloaded_block_size``, ``hash_block_size``,
        ``world_size`` and ``eviction_policy``.

        Raises:
            ValueError: when the config sizes the pool by ``num_cpu_blocks`` instead of
                ``cpu_bytes_to_use`` (a plan derives the slot count from bytes, docs/design.md
                invariant 3), and everything the constructor raises.
        """
        if config.cpu_bytes_to_use is None:
            raise ValueError(
                f"the configuration sizes the pool as num_cpu_blocks={config.num_cpu_blocks}; a "
                "CPUOffloadingSpec derives the slot count from bytes: set cpu_bytes_to_use "
                "instead (e.g. KVOFF_CPU_BYTES_TO_USE=64GiB)"
            )
        return cls(
            kv_cache_config,
            cpu_bytes_to_use=config.cpu_bytes_to_use,
            block_size=config.offloaded_block_size,
            hash_block_size=config.hash_block_size,
            world_size=config.world_size,
            eviction_policy=config.eviction_policy,
        )
