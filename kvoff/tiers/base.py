"""The interface of a secondary tier (below kvoff's CPU pool, L1) and shared helpers.

A secondary tier keeps whole offloaded blocks, one object per CPU pool slot, each written with
the header of :mod:`kvoff.tiers.block_format`. All operations take batches of offload keys
(``bytes``, 1..64 long) and are thread-safe: the coordinator calls :meth:`SecondaryTier.get`
from one background thread and :meth:`SecondaryTier.put` from another at the same time.

Failure model: I/O conditions (absent block, corrupt block, foreign fingerprint, timeout, node
down, disk full, unwritable path) are never exceptions. ``get`` answers False, ``put`` answers
False and counts the write in ``stats()["writes_dropped"]``. Exceptions are reserved for
programming errors (an ``out`` buffer of the wrong size, mismatched argument lengths).
"""

from __future__ import annotations

import math
import numbers
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from typing import Any, TypeVar

import numpy as np

from kvoff.tiers.block_format import BlockFormat

STAT_KEYS: tuple[str, ...] = (
    "hits",  # get(): blocks served (bytes copied into `outs`, valid)
    "misses",  # get(): blocks not served (absent, corrupt, foreign, timeout, error)
    "lookups",  # contains(): keys asked
    "lookup_hits",  # contains(): keys answered True
    "blocks_read",  # blocks whose bytes were read back from the medium
    "blocks_written",  # blocks stored
    "bytes_read",  # bytes read back (header + payload)
    "bytes_written",  # bytes stored (header + payload)
    "read_seconds",  # wall seconds inside get() calls
    "write_seconds",  # wall seconds inside put() calls
    "writes_dropped",  # put() keys answered False (full, unwritable, timeout, error)
    "corrupted_blocks",  # blocks rejected for a bad header or payload checksum (never served)
    "fingerprint_mismatches",  # blocks of another model / layout / rank seen and not served
    # blocks rejected for their MAC (never served): with a shared_secret, a plain block, one of
    # another secret or with a byte changed; without one, a MAC'd block (block_format "auth")
    "unauthenticated_blocks",
    "timeouts",  # operations that ran into the tier's timeout
    "evictions",  # blocks removed: evict() calls and the tier's own eviction
    "io_errors",  # OSError / connection errors met (each is also a miss or a dropped write)
)
"""Counters every tier reports (extras are tier-specific)."""


class TierStats:
    """Thread-safe counters: ``add(hits=3, bytes_read=...)``, ``snapshot() -> dict``."""

    def __init__(self, extra: Sequence[str] = ()) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int | float] = {k: 0 for k in (*STAT_KEYS, *extra)}
        for k in ("read_seconds", "write_seconds"):
            self._values[k] = 0.0

    def add(self, **deltas: float) -> None:
        """Add ``deltas`` to the named counters (unknown names are created)."""
        with self._lock:
            for k, v in deltas.items():
                self._values[k] = self._values.get(k, 0) + v

    def set(self, **values: float) -> None:
        """Set the named gauges (e.g. ``blocks`` held, ``direct_io``)."""
        with self._lock:
            self._values.update(values)

    def snapshot(self) -> dict[str, int | float]:
        """A copy of all counters."""
        with self._lock:
            return dict(self._values)


def byte_view(arr: Any, nbytes: int, what: str, *, writable: bool = False) -> memoryview:
    """A flat writable-or-not uint8 memoryview of ``arr`` (numpy array or bytes-like), of
    ``nbytes`` bytes.

    Every layout check is done here, before a tier takes a slot or starts I/O: a strided
    buffer (a numpy array or a memoryview with a step) would otherwise fail inside the I/O.

    Raises:
        ValueError: not C-contiguous (a strided numpy array or memoryview), not ``nbytes``
            bytes, or read-only when ``writable``.
        TypeError: ``arr`` does not expose a buffer (a list, None...).
    """
    if isinstance(arr, np.ndarray):
        if not arr.flags.c_contiguous:
            raise ValueError(
                f"{what} must be C-contiguous (a pool slot view), got strides {arr.strides}; "
                f"pass a contiguous array (numpy.ascontiguousarray)"
            )
        if writable and not arr.flags.writeable:
            raise ValueError(f"{what} is read-only; pass a writable uint8 array")
        arr = arr.reshape(-1)
        if arr.dtype != np.uint8:
            arr = arr.view(np.uint8)
    try:
        view = memoryview(arr)
    except TypeError:
        raise TypeError(
            f"{what} must be a uint8 numpy array or a bytes-like object of {nbytes} bytes, got "
            f"{type(arr).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError(
            f"{what} must be C-contiguous (a pool slot view), got a strided buffer (shape "
            f"{view.shape}, strides {view.strides}); pass a contiguous array or a copy "
            f"(numpy.ascontiguousarray, bytes(...))"
        )
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if view.nbytes != nbytes:
        raise ValueError(f"{what} is {view.nbytes} bytes; the tier's payload_bytes is {nbytes}")
    if writable and view.readonly:
        raise ValueError(f"{what} is read-only; pass a writable uint8 array")
    return view


_NO_BUFS: Any = object()


def check_batch(keys: Sequence[bytes], bufs: Sequence[Any] = _NO_BUFS, what: str = "") -> None:
    """Checks a batch's keys (bytes of 1..64 each) and, if given, its buffers ``bufs`` (one per
    key; ``what`` names them).

    Raises:
        TypeError: ``keys`` or ``bufs`` is not a list or tuple (a single key, None...);
            ``bufs`` may also be an array of 2 or more dimensions, a block per row.
        ValueError: a key that is not bytes of 1..64, or not one buffer per key.
    """
    if not isinstance(keys, (list, tuple)):
        raise TypeError(
            f"keys must be a list or tuple of offload keys (bytes), got {type(keys).__name__}; "
            "wrap a single key in a list"
        )
    if bufs is _NO_BUFS:
        bufs = None
    elif not (isinstance(bufs, (list, tuple)) or (isinstance(bufs, np.ndarray) and bufs.ndim >= 2)):
        raise TypeError(
            f"{what} must be a list or tuple of buffers, one per key (or an array of a row per "
            f"key), got {type(bufs).__name__}; wrap a single one in a list"
        )
    for k in keys:
        if not isinstance(k, (bytes, bytearray)) or not 1 <= len(k) <= 64:
            raise ValueError(f"offload keys must be bytes of 1..64, got {k!r}")
    if bufs is not None and len(bufs) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(bufs)} {what}; pass one per key")


def check_int(value: Any, name: str, *, minimum: int, hint: str, maximum: int | None = None) -> int:
    """``value`` as an ``int``: a Python or NumPy integer (not a bool) in
    ``minimum..maximum``. ``hint`` ends the messages (an example, or where the bound comes from).

    Raises:
        TypeError: ``value`` is not an integer (a bool, float, str, None...).
        ValueError: ``value`` is below ``minimum`` or above ``maximum``.
    """
    bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name}={value!r} must be an int {bounds}, not a {type(value).__name__} ({hint})"
        )
    n = int(value)
    if n < minimum or (maximum is not None and n > maximum):
        raise ValueError(f"{name}={value!r} must be an int {bounds} ({hint})")
    return n


def check_seconds(
    value: Any, name: str, *, hint: str, allow_zero: bool = False, maximum: float | None = None
) -> float:
    """``value`` as a ``float`` of seconds: a finite real number (int or float, Python or NumPy,
    not a bool), > 0 (>= 0 with ``allow_zero``), at most ``maximum``. ``hint`` ends the messages.

    Raises:
        TypeError: ``value`` is not a real number (a bool, str, None...).
        ValueError: ``value`` is NaN, infinite, not above 0 (below 0 with ``allow_zero``) or
            above ``maximum``.
    """
    bounds = ">= 0" if allow_zero else "> 0"
    if maximum is not None:
        bounds += f" and <= {maximum:g}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name}={value!r} must be a number of seconds {bounds}, not a "
            f"{type(value).__name__} ({hint})"
        )
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    if (
        not math.isfinite(seconds)
        or seconds < 0
        or (seconds == 0 and not allow_zero)
        or (maximum is not None and seconds > maximum)
    ):
        raise ValueError(f"{name}={value!r} must be a finite number of seconds {bounds} ({hint})")
    return seconds


_T = TypeVar("_T")


def run_all(pool: Executor, fn: Callable[..., _T], calls: Sequence[tuple[Any, ...]]) -> list[_T]:
    """``fn(*args)`` for every ``args`` in ``calls`` on ``pool``; the results in order.

    Every call that was submitted has finished before this returns or raises, so no thread is
    still writing into a caller's buffer (a CPU slot that may be freed and reused) when the
    caller sees the first exception.

    Raises:
        The first exception of a call, in call order; RuntimeError when the pool is shut down
        (the calls already submitted are waited for first).
    """
    futures: list[Future[_T]] = []
    try:
        for args in calls:
            futures.append(pool.submit(fn, *args))
    finally:
        wait(futures)
    return [f.result() for f in futures]


class CallGate:
    """A tier's calls in flight, counted so that its ``close`` can wait for them.

    :meth:`enter` counts a call (False once closed: the call answers misses), :meth:`exit`
    uncounts it, :meth:`close` refuses new calls and waits until none is in flight. The gate
    locks the tier's own lock, so the tier reads :attr:`closed` under it with its other state.
    """

    def __init__(self, lock: threading.Lock) -> None:
        self._idle = threading.Condition(lock)
        self._inflight = 0
        self.closed = False

    def enter(self) -> bool:
        """Counts a call in flight; False (nothing counted) once closed."""
        with self._idle:
            if self.closed:
                return False
            self._inflight += 1
            return True

    def exit(self) -> None:
        """Ends a call that :meth:`enter` counted."""
        with self._idle:
            self._inflight -= 1
            if not self._inflight:
                self._idle.notify_all()

    def close(self) -> bool:
        """Refuses new calls and waits for those in flight; False when it was closed already."""
        with self._idle:
            if self.closed:
                return False
            self.closed = True
            while self._inflight:
                self._idle.wait()
            return True


class SecondaryTier(ABC):
    """A store of whole blocks below the CPU pool (disk, a shared Redis Cluster, ...).

    Attributes:
        name: short tier name for reports (``"disk"``, ``"remote"``).
        fmt: the block format: fingerprint and payload size every block must match.

    Every method is thread-safe and answers per key; none raises for I/O conditions.
    """

    name: str
    fmt: BlockFormat

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is probably held (an index or EXISTS answer; the bytes are only
        verified by :meth:`get`). Returns one bool per key; never raises for I/O conditions."""

    @abstractmethod
    def get(self, keys: Sequence[bytes], outs: Sequence[np.ndarray]) -> list[bool]:
        """Read blocks into ``outs``.

        Args:
            keys: offload keys.
            outs: one writable, C-contiguous uint8 array of ``fmt.payload_bytes`` per key (a view
                into a CPU pool slot; need not be aligned).

        Returns:
            One bool per key: True = ``outs[i]`` holds the block, byte-exact and verified
            (header, fingerprint, key, length, checksum). False = not served (absent, corrupt,
            foreign fingerprint, timeout, node down, I/O error); ``outs[i]`` may then hold
            anything. A corrupt or foreign block is dropped and counted.

        Raises:
            ValueError: an ``outs`` entry of the wrong size / layout, or len(outs) != len(keys).
            TypeError: ``keys`` or ``outs`` is not a list or tuple, or an entry of ``outs`` is
                not a buffer.
        """

    @abstractmethod
    def put(self, keys: Sequence[bytes], payloads: Sequence[np.ndarray]) -> list[bool]:
        """Store blocks.

        Args:
            keys: offload keys.
            payloads: one C-contiguous array of ``fmt.payload_bytes`` bytes per key.

        Returns:
            One bool per key: True = stored (or already held), False = dropped (full,
            unwritable, timeout, error) and counted in ``stats()["writes_dropped"]``.

        Raises:
            ValueError: a payload of the wrong size / layout, or len(payloads) != len(keys).
            TypeError: ``keys`` or ``payloads`` is not a list or tuple, or a payload is not a
                buffer.
        """

    @abstractmethod
    def evict(self, keys: Sequence[bytes]) -> int:
        """Remove blocks; returns how many of ``keys`` were present. Never raises for I/O."""

    @abstractmethod
    def clear(self) -> int:
        """Forget every block stored before the call, for a cache reset (the engine's weights
        changed, so blocks made before are wrong KV): from its return on, no block that a
        ``put`` started before the call is served to this process (``contains`` answers False,
        ``get`` misses), and later puts are served as usual. Returns how many blocks it dropped
        where the tier can count them (a shared store, which cannot, returns 0). Never raises
        for I/O conditions; 0 once the tier is closed."""

    @abstractmethod
    def stats(self) -> dict[str, int | float]:
        """Counters (:data:`STAT_KEYS` at least, plus tier-specific ones)."""

    @abstractmethod
    def close(self) -> None:
        """Release files, threads and connections. Later calls answer False / drop."""

    def __enter__(self) -> SecondaryTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
