"""The CPU pool's memory: one exact-size allocation, page-locked by one call.

``torch.empty(..., pin_memory=True)`` goes through torch's pinned caching allocator, which
rounds every request up to a power of two: a 300 GiB pool would lock 512 GiB, or fail
(DESIGN.md "Moving bytes"). kvoff instead allocates exactly the bytes the pool needs (ordinary
host memory from torch's CPU allocator) and page-locks them with one ``cudaHostRegister``
call; a failure names the pool size and what to lower. The memory is registered portable and
mapped, so copy calls and the SM kernel (through the device pointer; with unified addressing
it is the host pointer) can both use it.

One registration, not several: copy calls refuse a host range that spans two registrations.
On an H200 (CUDA 13.0, driver 580.159.04, 2026-11-24) a copy of one row straddling the
boundary of two ``cudaHostRegister`` ranges failed with ``cudaErrorInvalidValue`` through
``cudaMemcpyAsync`` and ``cudaMemcpyBatchAsync`` (only the SM kernel, through mapped addresses,
copied it), and so did the ``memcpy`` mechanism's copy of a run of adjacent rows across the
boundary (``.ci/results/h200-2026-11-24``). A pool pinned in 1 GiB chunks therefore failed every
job whose block, or run of adjacent blocks, crossed a cut (``kvoff bench transfer``:
DeepSeek-V3 MLA's 4.3 MiB blocks).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["HostPool", "PinningError"]

_ALIGN = 4096  # every tensor of the pool starts on its own page
_CUDA_HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable (cuda_runtime_api.h)
_CUDA_HOST_REGISTER_MAPPED = 0x02  # cudaHostRegisterMapped


class PinningError(RuntimeError):
    """Page-locking the CPU pool failed; the message says how much was asked and what to lower."""


def _memlock_limit() -> str:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError):
        return "unknown"
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**30:.2f} GiB"


@dataclass(frozen=True)
class _Registrar:
    """The two CUDA runtime calls pinning needs (injectable for tests)."""

    register: Callable[[int, int, int], int]  # (address, bytes, flags) -> cudaError_t
    unregister: Callable[[int], int]  # (address) -> cudaError_t
    error_string: Callable[[int], str]


def _cuda_registrar() -> _Registrar:
    if not torch.cuda.is_available():
        raise PinningError(
            "pin_memory=True needs CUDA, but torch.cuda.is_available() is False (a CPU build of "
            "torch, or no GPU visible); use pin_memory=False"
        )
    cudart = torch.cuda.cudart()

    def error_string(code: int) -> str:
        try:
            return str(cudart.cudaGetErrorString(code))
        except (AttributeError, RuntimeError, TypeError):
            return f"cudaError {int(code)}"

    return _Registrar(
        lambda ptr, size, flags: int(cudart.cudaHostRegister(ptr, size, flags)),
        lambda ptr: int(cudart.cudaHostUnregister(ptr)),
        error_string,
    )


def _unregister_all(registrar: _Registrar, addresses: list[int], _keep: torch.Tensor) -> None:
    # `_keep` holds the memory until it is unregistered (freeing registered memory is an error).
    for address in reversed(addresses):
        registrar.unregister(address)
    addresses.clear()


class HostPool:
    """One host allocation holding several 2-D uint8 tensors back to back, optionally pinned.

    Args:
        shapes: ``(rows, row_bytes)`` of each tensor, in order; each starts on a 4 KiB boundary.
        pin: page-lock the memory (one ``cudaHostRegister`` call for the whole pool).
        description: what the pool is for, used in error messages (e.g. "4096 CPU blocks of
            2.0 MiB").

    Attributes:
        tensors: the ``(rows, row_bytes)`` uint8 tensors, in ``shapes`` order.
        num_bytes: bytes allocated: the sum of ``rows × row_bytes`` plus at most 4 KiB of
            alignment per tensor (no power-of-two rounding).
        pinned: whether the memory is page-locked.

    Raises:
        ValueError: for a negative shape.
        PinningError: when page-locking fails (nothing stays registered then): the message
            gives the bytes asked for, the CUDA error and the
            locked-memory limit, and says to lower the pool size or raise the limit; also when
            ``pin`` is asked for without CUDA.
        RuntimeError: when the host allocation itself fails (torch's out-of-memory error).
    """

    def __init__(
        self,
        shapes: Sequence[tuple[int, int]],
        *,
        pin: bool,
        description: str = "the CPU pool",
        _registrar: _Registrar | None = None,
    ) -> None:
        offsets = []
        total = 0
        for rows, row_bytes in shapes:
            if rows < 0 or row_bytes < 0:
                raise ValueError(f"tensor shapes must be non-negative, got {(rows, row_bytes)}")
            total = -(-total // _ALIGN) * _ALIGN
            offsets.append(total)
            total += rows * row_bytes
        self.num_bytes = total
        registrar = (_registrar or _cuda_registrar()) if pin and total > 0 else None
        self._base = torch.empty(total, dtype=torch.uint8)
        self.tensors = [
            self._base[off : off + rows * row_bytes].view(rows, row_bytes)
            for off, (rows, row_bytes) in zip(offsets, shapes, strict=True)
        ]
        self._addresses: list[int] = []
        self.pinned = False
        if registrar is not None:
            self._register(registrar, description)
            self.pinned = True
            self._finalizer = weakref.finalize(
                self, _unregister_all, registrar, self._addresses, self._base
            )

    def _register(self, registrar: _Registrar, description: str) -> None:
        base = self._base.data_ptr()
        flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
        err = registrar.register(base, self.num_bytes, flags)
        if err != 0:
            gib = self.num_bytes / 2**30
            raise PinningError(
                f"pinning {description} failed: {self.num_bytes} bytes ({gib:.2f} GiB) asked "
                f"for were refused: {registrar.error_string(err)}. Lower the pool size "
                f"(num_cpu_blocks, or cpu_bytes_to_use in the config) or raise the locked-memory "
                f"limit (ulimit -l; now {_memlock_limit()}); pin_memory=False avoids pinning at "
                f"the cost of slower, synchronous copies."
            )
        self._addresses.append(base)

    def close(self) -> None:
        """Unregister the memory now (it is freed when the last tensor view goes away).
        Idempotent; the pool's tensors must not be used for GPU copies afterwards."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        self.pinned = False
