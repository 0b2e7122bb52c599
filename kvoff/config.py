"""The offloading configuration: how big the CPU pool is, how big an offloaded block is, and
which eviction policy runs it. Validated by pydantic; the spec issue grows it into the single
configuration object of the library (files, environment, CLI)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, PositiveInt, field_validator, model_validator

from kvoff.sizing import compute_num_cpu_blocks

__all__ = ["EVICTION_POLICIES", "OffloadingConfig"]


def _eviction_policies() -> tuple[str, ...]:
    from kvoff import _scheduler

    return tuple(_scheduler.eviction_policies())


EVICTION_POLICIES: tuple[str, ...] = _eviction_policies()
"""Names accepted by ``eviction_policy`` (from the C++ policy registry)."""


class OffloadingConfig(BaseModel):
    """Configuration of one kvoff CPU pool (frozen; unknown keys are rejected).

    Exactly one of ``cpu_bytes_to_use`` and ``num_cpu_blocks`` sizes the pool.

    Attributes:
        cpu_bytes_to_use: bytes of CPU memory for the pool, summed over all tensor-parallel
            ranks. The slot count is derived by :func:`kvoff.sizing.compute_num_cpu_blocks`.
        num_cpu_blocks: the pool size in offloaded blocks (slots), when given directly.
        offloaded_block_size: tokens per offloaded block (the CPU-side unit). ``None`` means
            the GPU block size (``block_size_factor == 1``). Must be a multiple of the GPU
            ``block_size``.
        eviction_policy: one of :data:`EVICTION_POLICIES`.

    Raises:
        pydantic.ValidationError (a ``ValueError``): on a non-positive size, both or neither of
            the two sizes, an unknown policy (the message lists the choices) or an unknown key.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_bytes_to_use: PositiveInt | None = None
    num_cpu_blocks: PositiveInt | None = None
    offloaded_block_size: PositiveInt | None = None
    eviction_policy: str = "lru"

    @field_validator("eviction_policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        name = value.strip().lower()
        if name not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction_policy {value!r}; choose one of {list(EVICTION_POLICIES)}"
            )
        return name

    @model_validator(mode="after")
    def _one_size(self) -> OffloadingConfig:
        if (self.cpu_bytes_to_use is None) == (self.num_cpu_blocks is None):
            raise ValueError(
                "size the CPU pool with exactly one of cpu_bytes_to_use (bytes) or "
                f"num_cpu_blocks (offloaded blocks); got cpu_bytes_to_use="
                f"{self.cpu_bytes_to_use}, num_cpu_blocks={self.num_cpu_blocks}"
            )
        return self

    def block_size_factor(self, block_size: int) -> int:
        """GPU blocks per offloaded block for GPU blocks of ``block_size`` tokens.

        Raises:
            ValueError: when ``offloaded_block_size`` is not a multiple of ``block_size``.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
        obs = self.offloaded_block_size or block_size
        if obs % block_size:
            raise ValueError(
                f"offloaded_block_size={obs} tokens is not a multiple of the GPU block_size="
                f"{block_size} tokens; use a multiple such as "
                f"{max(1, obs // block_size) * block_size}"
            )
        return obs // block_size

    def resolve_num_cpu_blocks(
        self, bytes_per_gpu_block: int, block_size: int, world_size: int = 1
    ) -> int:
        """Slots of the CPU pool: ``num_cpu_blocks``, or derived from ``cpu_bytes_to_use``.

        Args:
            bytes_per_gpu_block: bytes of one GPU block over all layers of one rank.
            block_size: GPU tokens per block.
            world_size: tensor-parallel ranks.

        Raises:
            ValueError: when ``cpu_bytes_to_use`` cannot hold even one offloaded block; the
                message gives the bytes one offloaded block needs.
        """
        factor = self.block_size_factor(block_size)
        if self.num_cpu_blocks is not None:
            return self.num_cpu_blocks
        assert self.cpu_bytes_to_use is not None
        n = compute_num_cpu_blocks(self.cpu_bytes_to_use, bytes_per_gpu_block, factor, world_size)
        if n == 0 and bytes_per_gpu_block > 0:
            need = bytes_per_gpu_block * factor * world_size
            raise ValueError(
                f"cpu_bytes_to_use={self.cpu_bytes_to_use} bytes cannot hold one offloaded block "
                f"({need} bytes = {bytes_per_gpu_block} bytes per GPU block × block_size_factor "
                f"{factor} × world_size {world_size}); raise cpu_bytes_to_use to at least {need}"
            )
        return n
