"""An engine's side of the node pool: the manager's calls, batched, over the pool's socket.

:class:`NodePoolClient` has the calls of kvoff's manager that an engine's pool side makes
(``lookup``, ``prepare_load``, ``complete_load``, ``prepare_store``, ``complete_store``,
``touch``), so the request loop uses it where it would use a private manager. Keys are
prefixed with 8 bytes of the engine's layout fingerprint (BLAKE2b of it), so engines of
another model, dtype, layout or rank never share a block; keys the pool returns (evictions of
other engines' blocks) keep their prefix.

**A pool that is gone is a miss, never an error.** When the socket fails (the pool was stopped
or crashed), every call answers as an empty pool would: ``lookup`` 0, ``prepare_store`` None
(nothing stored), completions dropped; the client tries to reconnect at most every
``retry_s`` seconds. A reconnected pool that serves another region (a new shared-memory file:
the pool was restarted cleanly, not adopted) cannot be used with this engine's mapping: the
client stays detached (misses) and says so once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvoff.node_pool import protocol as p

__all__ = ["NodePoolClient", "NodePoolError", "StoreSlots", "wait_for_pool"]

logger = logging.getLogger(__name__)


class NodePoolError(RuntimeError):
    """The node pool refused a call (the message is the pool's) or could not be reached at
    attach time."""


@dataclass(frozen=True)
class StoreSlots:
    """``prepare_store``'s answer: the keys to store (this engine's, unprefixed), their slots
    (CPU block ids in the region), and the keys evicted to make room (prefixed keys of any
    engine)."""

    keys_to_store: list[bytes]
    block_ids: list[int]
    evicted_keys: list[bytes]


class NodePoolClient:
    """A connection to ``kvoff pool serve`` at ``socket_path``.

    Args:
        socket_path: the pool's socket.
        fingerprint: this engine's layout fingerprint (model, dtype, layout, rank, block
            sizes: :func:`kvoff.tiers.block_format.layout_fingerprint`).
        name: how ``kvoff pool status`` names this engine.
        timeout_s: seconds a call may take before the pool counts as gone.
        retry_s: seconds between reconnection attempts.

    Attributes:
        region, num_slots, slot_bytes, inode: the pool's shared memory, from its hello.
        stores_skipped: blocks the manager's admission filter skipped (0: the filter runs in
            the pool; kept for the manager's interface).
        misses_while_detached: calls answered as misses because the pool was gone.

    Raises:
        NodePoolError: nothing answers at ``socket_path`` (start ``kvoff pool serve``).
    """

    def __init__(
        self,
        socket_path: str,
        fingerprint: bytes,
        *,
        name: str = "",
        timeout_s: float = 5.0,
        retry_s: float = 1.0,
    ) -> None:
        self.socket_path = socket_path
        self.prefix = hashlib.blake2b(fingerprint, digest_size=8).digest()
        self.name = name or f"pid-{os.getpid()}"
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.stores_skipped = 0
        self.misses_while_detached = 0
        self._sock: socket.socket | None = None
        self._rest = bytearray()
        self._next_try = 0.0
        self._rid = 0
        self._region_lost = False
        # what this connection holds: a pool that went away released it, so completions of
        # what an earlier connection held are dropped, not sent
        self._pins: Counter[bytes] = Counter()
        self._storing: set[bytes] = set()
        self._warned_clear = False
        self._counts_at = -1e9
        self._counts_cache: dict[str, Any] = {}
        try:
            hello = self._connect()
        except OSError as e:
            raise NodePoolError(
                f"no node pool answers at {socket_path} ({e}); start one with kvoff pool serve "
                "--socket ... or drop node_pool"
            ) from e
        self.region: str = hello["region"]
        self.inode: int | None = hello["inode"]
        self.num_slots: int = int(hello["num_slots"])
        self.slot_bytes: int = int(hello["slot_bytes"])

    # ------------------------------------------------------------------ transport
    def _connect(self) -> dict[str, Any]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
            self._sock = sock
            hello = p.decode_json(self._roundtrip(p.HELLO, p.encode_json({"name": self.name})))
        except BaseException:
            self._sock = None
            sock.close()
            raise
        return hello

    def _roundtrip(self, op: int, payload: bytes) -> bytes:
        assert self._sock is not None
        self._rid += 1
        self._sock.sendall(p.frame(op, self._rid, payload))
        head = self._recv(p.HEADER.size)
        rop, rid, length = p.parse_header(head)
        body = self._recv(length)
        if rop == p.ERROR:
            raise NodePoolError(body.decode(errors="replace"))
        if rid != self._rid or rop != op | p.REPLY:
            raise ConnectionError(f"reply {rop}/{rid} to request {op}/{self._rid}")
        return body

    def _recv(self, n: int) -> bytes:
        # one recv usually brings a whole reply: what is past n waits in self._rest
        assert self._sock is not None
        buf = self._rest
        while len(buf) < n:
            chunk = self._sock.recv(max(65536, n - len(buf)))
            if not chunk:
                raise ConnectionError("the node pool closed the connection")
            buf += chunk
        self._rest = buf[n:]
        return bytes(buf[:n])

    def _call(self, op: int, payload: bytes) -> bytes | None:
        """The reply's payload, or None when the pool is gone (the caller answers a miss)."""
        if self._sock is None and not self._reconnect():
            self.misses_while_detached += 1
            return None
        try:
            return self._roundtrip(op, payload)
        except (OSError, ConnectionError, p.ProtocolError) as e:
            logger.warning("kvoff node pool at %s is gone (%s): misses until it is back",
                           self.socket_path, e)  # fmt: skip
            self._close_socket()
            self.misses_while_detached += 1
            return None

    def _reconnect(self) -> bool:
        if self._region_lost or time.monotonic() < self._next_try:
            return False
        self._next_try = time.monotonic() + self.retry_s
        try:
            hello = self._connect()
        except (OSError, ConnectionError, p.ProtocolError, NodePoolError):
            return False
        same = (hello.get("region"), hello.get("inode"), hello.get("slot_bytes")) == (
            self.region, self.inode, self.slot_bytes,
        )  # fmt: skip
        if not same:
            logger.warning(
                "kvoff node pool at %s serves another region now (%s); this engine maps the "
                "old one and stays detached (misses) until it restarts",
                self.socket_path,
                hello,
            )
            self._region_lost = True
            self._close_socket()
            return False
        logger.info("kvoff node pool at %s is back", self.socket_path)
        return True

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._rest = bytearray()
        self._pins.clear()
        self._storing.clear()

    def close(self) -> None:
        """Leaves the pool (its pins and stores in flight are released by the pool)."""
        self._close_socket()
        self._region_lost = True

    @property
    def attached(self) -> bool:
        """Whether the last call reached the pool."""
        return self._sock is not None

    # ------------------------------------------------------------------ keys
    def _keys(self, keys: Sequence[bytes]) -> bytes:
        pre = self.prefix
        return p.encode_keys([pre + bytes(k) for k in keys])

    def _own(self, key: bytes) -> bytes:
        return key[8:] if key[:8] == self.prefix else key

    # ------------------------------------------------------------------ manager calls
    def lookup(self, keys: Sequence[bytes]) -> int | None:
        """Leading keys ready in the pool; None: retry later (one is being stored); 0 when
        the pool is gone."""
        reply = self._call(p.LOOKUP, self._keys(keys))
        if reply is None:
            return 0
        (n,) = struct.unpack("<q", reply)
        return None if n < 0 else n

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Pins the keys (looked up as ready) and returns their slots.

        Raises:
            NodePoolError: a key not ready, or the pool is gone (the load cannot happen: the
                caller counts it as a failed load).
        """
        reply = self._call(p.PREPARE_LOAD, self._keys(keys))
        if reply is None:
            raise NodePoolError("the node pool is gone: the load cannot be made")
        self._pins.update(bytes(k) for k in keys)
        return p.decode_slots(reply)[0]

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Unpins the keys of a finished load (those of a connection since lost are dropped:
        the pool released them)."""
        held = []
        for k in map(bytes, keys):
            if self._pins[k] > 0:
                self._pins[k] -= 1
                held.append(k)
        self._pins += Counter()
        if held:
            self._call(p.COMPLETE_LOAD, self._keys(held))

    def prepare_store(self, keys: Sequence[bytes]) -> StoreSlots | None:
        """Slots for the keys not held yet; None when the pool cannot make room or is gone."""
        reply = self._call(p.PREPARE_STORE, self._keys(keys))
        if reply is None or reply[:1] != b"\x01":  # gone, or no room
            return None
        to_store, off = p.decode_keys(reply, 1)
        slots, off = p.decode_slots(reply, off)
        evicted, _ = p.decode_keys(reply, off)
        mine = [self._own(k) for k in to_store]
        self._storing.update(mine)
        return StoreSlots(mine, slots, evicted)

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """Ends a store: the keys become hits (``success``) or are dropped (those of a
        connection since lost are dropped: the pool completed them as failed)."""
        held = [k for k in dict.fromkeys(map(bytes, keys)) if k in self._storing]
        self._storing.difference_update(held)
        if held:
            self._call(p.COMPLETE_STORE, bytes([bool(success)]) + self._keys(held))

    def touch(self, keys: Sequence[bytes], reused: Sequence[bool] | None = None) -> None:
        """Makes the keys the most recent, ``keys[0]`` first; ``reused``: per key, whether it
        was a reuse (as :meth:`kvoff.CPUOffloadingManager.touch`)."""
        flags = b"" if reused is None else bytes(1 if r else 0 for r in reused)
        self._call(p.TOUCH, self._keys(keys) + flags)

    # ------------------------------------------------------------------ the manager's rest
    def take_events(self) -> list[Any]:
        """No events: a node pool's index is shared, its BlockStored / BlockRemoved events are
        not per engine yet."""
        return []

    def clear(self, include_in_flight: bool = False) -> int:
        """Drops nothing and returns 0: the pool is shared by other engines, so one engine's
        cache reset must not empty it (``kvoff pool stop`` does)."""
        if not self._warned_clear:
            logger.warning(
                "kvoff: a cache reset does not clear the node pool at %s (other engines use "
                "it); kvoff pool stop empties it",
                self.socket_path,
            )
            self._warned_clear = True
        return 0

    def _counts(self) -> dict[str, Any]:
        """The pool's block counts, asked at most once a second (metrics read them each
        step); zeros while the pool is gone."""
        now = time.monotonic()
        if now - self._counts_at > 1.0:
            reply = self._call(p.STATUS, b"")
            self._counts_cache = {} if reply is None else p.decode_json(reply)
            self._counts_at = now
        return self._counts_cache

    @property
    def num_free_blocks(self) -> int:
        """Free slots in the pool (refreshed at most once a second)."""
        return int(self._counts().get("free_blocks", 0))

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks the pool may evict (refreshed at most once a second)."""
        return int(self._counts().get("evictable_blocks", 0))

    @property
    def num_pending_blocks(self) -> int:
        """Blocks being stored by any engine (refreshed at most once a second)."""
        return int(self._counts().get("pending_blocks", 0))

    @property
    def num_stored_blocks(self) -> int:
        """Blocks held (refreshed at most once a second)."""
        return int(self._counts().get("stored_blocks", 0))

    def status(self) -> dict[str, Any]:
        """The pool's status (``kvoff pool status``).

        Raises:
            NodePoolError: the pool is gone.
        """
        reply = self._call(p.STATUS, b"")
        if reply is None:
            raise NodePoolError(f"no node pool answers at {self.socket_path}")
        return p.decode_json(reply)


def wait_for_pool(socket_path: str, process: Any = None, timeout_s: float = 60.0) -> None:
    """Returns once a pool answers at ``socket_path`` (a killed pool's socket file may still
    be there, so a connection is what counts).

    Args:
        socket_path: the pool's socket.
        process: the pool's ``subprocess.Popen``, if this process started it: its exit ends
            the wait.
        timeout_s: seconds to wait at most.

    Raises:
        NodePoolError: the pool exited, or did not answer within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(socket_path)
            return
        except OSError:
            if process is not None and process.poll() is not None:
                raise NodePoolError(
                    f"the node pool for {socket_path} exited with code {process.returncode}"
                ) from None
            if time.monotonic() > deadline:
                raise NodePoolError(
                    f"no node pool answered at {socket_path} within {timeout_s:g} s"
                ) from None
            time.sleep(0.05)
        finally:
            probe.close()
