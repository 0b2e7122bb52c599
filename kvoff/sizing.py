"""CPU pool sizing: the one function that turns CPU bytes into CPU block slots, and the one
that gives the bytes per GPU block it divides by.

docs/design.md invariant 3: CPU block count = ``cpu_bytes_to_use // (bytes per GPU block over all
layers of one rank × world_size × block_size_factor)``, with bytes per GPU block = total bytes of
the KV cache tensors // ``num_blocks``. The scheduler and every worker call these same functions
so that their pools always agree.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

__all__ = ["bytes_per_gpu_block", "compute_num_cpu_blocks"]


def bytes_per_gpu_block(tensor_bytes: Iterable[int], num_blocks: int) -> int:
    """Bytes one GPU block id costs over the KV cache tensors of one rank, in bytes.

    docs/design.md invariant 3: the total bytes of the tensors // the number of GPU blocks they
    hold; not page size × number of tensors (a ``UniformTypeKVCacheSpecs`` page already sums its
    layers, and a tensor shared by several layers or groups holds each block once). Every place
    that needs the figure (the plan, the worker's slot, the tools' byte counts) computes it here.

    Args:
        tensor_bytes: the size in bytes of each distinct KV cache tensor (one shared by several
            layers or groups counted once). Sizes of one block of each tensor, with
            ``num_blocks=1``, give the same figure.
        num_blocks: GPU blocks the tensors hold (``KVCacheConfig.num_blocks``, never a tensor's
            leading dimension: invariant 2).

    Returns:
        ``sum(tensor_bytes) // num_blocks``; 0 when ``num_blocks`` is 0 (no GPU blocks: nothing
        to offload, not a division error).

    Raises:
        TypeError: a size or count that is not an int (a bool is not; numpy integers are taken).
        ValueError: a negative size or count.
    """
    num_blocks = _count("num_blocks", num_blocks)
    sizes = [_count("tensor_bytes", size) for size in tensor_bytes]
    if num_blocks < 0 or any(size < 0 for size in sizes):
        raise ValueError(
            f"bytes_per_gpu_block needs num_blocks >= 0 and tensor sizes >= 0 bytes, got "
            f"num_blocks={num_blocks} and sizes {sizes[:8]}{'...' if len(sizes) > 8 else ''}"
        )
    return sum(sizes) // num_blocks if num_blocks else 0


def compute_num_cpu_blocks(
    cpu_bytes_to_use: int,
    bytes_per_gpu_block: int,
    block_size_factor: int,
    world_size: int = 1,
) -> int:
    """Number of CPU block slots (offloaded blocks) that fit in ``cpu_bytes_to_use``.

    Args:
        cpu_bytes_to_use: bytes of CPU memory for the pool, summed over all ranks.
        bytes_per_gpu_block: bytes of one GPU block over all layers of ONE rank (for a
            ``KVCacheConfig``: total bytes of its tensors // its ``num_blocks``). 0 when the
            engine has no GPU blocks.
        block_size_factor: GPU blocks per offloaded block (``offloaded_block_size //
            block_size``).
        world_size: tensor-parallel ranks; each keeps its shard of every slot.

    Returns:
        ``cpu_bytes_to_use // (bytes_per_gpu_block × world_size × block_size_factor)`` slots, or
        0 when ``bytes_per_gpu_block`` is 0 (no GPU blocks: nothing to offload).

    Raises:
        TypeError: when an argument is not an int (a float, NaN, a str or a bool): a
            fractional byte or block count has no meaning here. numpy integers are taken (as
            Python ints, so that the product cannot wrap around).
        ValueError: when an argument is negative, or ``block_size_factor`` / ``world_size`` is
            not positive; the message names the value.
    """
    cpu_bytes_to_use = _count("cpu_bytes_to_use", cpu_bytes_to_use)
    bytes_per_gpu_block = _count("bytes_per_gpu_block", bytes_per_gpu_block)
    block_size_factor = _count("block_size_factor", block_size_factor)
    world_size = _count("world_size", world_size)
    if cpu_bytes_to_use < 0:
        raise ValueError(f"cpu_bytes_to_use must be >= 0 bytes, got {cpu_bytes_to_use}")
    if bytes_per_gpu_block < 0:
        raise ValueError(f"bytes_per_gpu_block must be >= 0 bytes, got {bytes_per_gpu_block}")
    if block_size_factor < 1:
        raise ValueError(f"block_size_factor must be >= 1, got {block_size_factor}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bytes_per_gpu_block == 0:
        return 0
    return cpu_bytes_to_use // (bytes_per_gpu_block * world_size * block_size_factor)


def _count(name: str, value: object) -> int:
    """``value`` as a Python int.

    Raises:
        TypeError: ``value`` is not an integer (a bool is not).
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(
            f"{name} must be an int, got {value!r} ({type(value).__name__}); pass a whole "
            "number of bytes or blocks"
        )
    return operator.index(value)  # type: ignore[arg-type]
