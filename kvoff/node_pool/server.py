"""The node pool's server: one CPU pool in shared memory and one index for every engine on a
machine (``kvoff pool serve``).

Why a server process owns the index, rather than an index in shared memory: the index is
kvoff's C++ manager (:class:`kvoff._scheduler.CPUOffloadingManager`, every eviction policy and
the admission filter) used as it is, and an engine that dies at any moment cannot leave it half
updated, because only this process changes it. The server knows what each engine holds by its
connection: when an engine's connection closes, for whatever reason (SIGKILL included, the
kernel closes the socket), its pins are released and its stores in flight are completed as
failed, so they never become hits and no slot is leaked. The bytes never pass through the
socket: the slots live in ``/dev/shm/<region>``, which every engine maps (and pins) once, and
the socket carries only batched key lists and slot ids.

Trust: the socket file is created with mode 0600 (0660 with ``group``), and every connection's
peer credentials (``SO_PEERCRED``) must be this process's user, or ``group`` when given; others
are refused at once. A message that does not parse gets an error reply; a frame whose header is
wrong closes that connection only. Every call is checked against what the connection holds: an
engine can complete only its own loads and stores.

One thread serves every connection in turn (``selectors``), so the manager needs no lock and
calls are atomic. A restarted server adopts the region of a server that died (same name and
layout, owner gone): engines that still map it keep working and hit again as they store; the
index starts empty.
"""

from __future__ import annotations

import contextlib
import os
import queue
import selectors
import signal
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvoff import _scheduler
from kvoff.node_pool import protocol as p
from kvoff.pinned import HostPool, SharedMemoryError

__all__ = ["DEFAULT_REGION", "NodePoolServer"]

DEFAULT_REGION = "kvoff-node-pool"
"""The default shared-memory name of the pool (``/dev/shm/kvoff-node-pool``)."""


@dataclass
class _Engine:
    """One connection: an engine (or a tool) attached to the pool."""

    sock: socket.socket
    pid: int
    uid: int
    name: str = ""
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    pins: Counter[bytes] = field(default_factory=Counter)  # key -> loads in flight
    storing: set[bytes] = field(default_factory=set)  # keys it is storing
    calls: int = 0
    lookups: int = 0
    looked_up_keys: int = 0
    hit_keys: int = 0
    stored_keys: int = 0
    loaded_keys: int = 0
    errors: int = 0
    since: float = field(default_factory=time.time)
    mask: int = selectors.EVENT_READ


class NodePoolServer:
    """The pool and its index, served on a Unix socket.

    Args:
        socket_path: where to listen (a file that exists is replaced if no server answers on
            it; one that answers is an error).
        num_slots: CPU blocks in the pool (offloaded blocks; >= 1).
        slot_bytes: bytes of one CPU block (>= 1); every engine that attaches must use it.
        policy: eviction policy of the index (``lru``, ``arc``, ... as the manager takes).
        region: the shared-memory name of the slots (``/dev/shm/<region>``).
        group: a group id whose members may attach too (default: only this user).
        store_threshold: the manager's store admission (offers before a block is stored).

    Raises:
        ValueError: a bad size, policy or name, or another server answering on
            ``socket_path``.
        SharedMemoryError: ``/dev/shm`` too small, or a live server already owns ``region``.
    """

    def __init__(
        self,
        socket_path: str,
        num_slots: int,
        slot_bytes: int,
        *,
        policy: str = "lru",
        region: str = DEFAULT_REGION,
        group: int | None = None,
        store_threshold: int = 0,
    ) -> None:
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError(
                f"a node pool needs num_slots >= 1 and slot_bytes >= 1, got {num_slots} and "
                f"{slot_bytes}; give --bytes (or --slots) and the engines' slot size"
            )
        self.socket_path = os.path.abspath(socket_path)
        self.num_slots, self.slot_bytes = int(num_slots), int(slot_bytes)
        self.group = group
        self.manager = _scheduler.CPUOffloadingManager(
            self.num_slots, policy, store_threshold=store_threshold
        )
        self.policy = policy
        self.region = region
        self.adopted = False
        self.pool = self._region(region)
        self.engines: dict[int, _Engine] = {}  # by fd
        self.evictions = 0
        self.engines_seen = 0
        self.refused = 0
        self.started = time.time()
        self._stop = False
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._listener = self._listen()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)

    # ------------------------------------------------------------------ setup
    def _region(self, name: str) -> HostPool:
        shape = [(self.num_slots, self.slot_bytes)]
        desc = f"the node pool ({self.num_slots} slots of {self.slot_bytes} bytes)"
        try:  # a server that died left its region: adopt it, engines still map it
            pool = HostPool(shape, pin=False, shared_name=name, attach=True, description=desc)
        except SharedMemoryError:
            return HostPool(shape, pin=False, shared_name=name, description=desc)
        from kvoff.pinned import (
            SHM_HEADER_BYTES,
            _pack_header,
            _parse_header,
            _pool_owner,
            _shm_path,
        )

        owner = _pool_owner(_shm_path(name))
        if owner is not None and owner != os.getpid():
            pool.close()
            raise SharedMemoryError(
                f"/dev/shm/{name} belongs to process {owner}, which still runs: another node "
                "pool serves it; stop it first or give another --region"
            )
        head = pool._storage[:SHM_HEADER_BYTES]
        meta = _parse_header(bytes(head.numpy()))
        assert meta is not None  # attach checked it
        meta["pid"] = os.getpid()  # this server owns it now
        packed = _pack_header(meta)
        head[: len(packed)].copy_(torch.frombuffer(bytearray(packed), dtype=torch.uint8))
        self.adopted = True
        return pool

    def _listen(self) -> socket.socket:
        path = self.socket_path
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # a dead server's socket
            else:
                probe.close()
                raise ValueError(
                    f"a node pool already serves {path}; stop it (kvoff pool stop) or give "
                    "another --socket"
                )
        old = os.umask(0o117 if self.group is not None else 0o177)
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
        finally:
            os.umask(old)
        if self.group is not None:
            os.chown(path, -1, self.group)
        sock.listen(128)
        sock.setblocking(False)
        return sock

    # ------------------------------------------------------------------ loop
    def serve_forever(self, poll_s: float = 0.5) -> None:
        """Serves until :meth:`stop` (or SIGTERM / SIGINT, when called in the main thread)."""
        with contextlib.suppress(ValueError):  # not the main thread: no signal handlers
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        while not self._stop:
            self.serve_once(poll_s)
        self.close()

    def serve_once(self, timeout: float = 0.0) -> None:
        """Handles what is ready now (waiting at most ``timeout`` seconds)."""
        for key, events in self._selector.select(timeout):
            if key.data is None:
                self._accept()
                continue
            eng: _Engine = key.data
            if events & selectors.EVENT_READ:
                self._read(eng)
            if events & selectors.EVENT_WRITE and eng.sock.fileno() in self.engines:
                self._flush(eng)
        while not self._calls.empty():
            self._calls.get()()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Runs ``fn()`` in the serving thread after its current round (thread-safe): how
        another thread of this process reads or changes the pool without racing it."""
        self._calls.put(fn)

    def stop(self) -> None:
        """Ends :meth:`serve_forever` after the current round."""
        self._stop = True

    def close(self) -> None:
        """Drops every connection (their pins and stores released), removes the socket and
        the region's name (engines keep their mappings). Idempotent."""
        for eng in list(self.engines.values()):
            self._drop(eng)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        from kvoff.pinned import _shm_path, _unlink_if_same

        if getattr(self.pool, "inode", None) is not None:
            _unlink_if_same(_shm_path(self.region), self.pool.inode)
        self.pool.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", creds)
        allowed = uid == os.getuid() or (self.group is not None and gid == self.group)
        if not allowed:  # another user: refused before reading a byte
            self.refused += 1
            sock.close()
            return
        sock.setblocking(False)
        eng = _Engine(sock, pid, uid)
        self.engines[sock.fileno()] = eng
        self.engines_seen += 1
        self._selector.register(sock, selectors.EVENT_READ, eng)

    def _read(self, eng: _Engine) -> None:
        try:
            data = eng.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(eng)
            return
        eng.inbox += data
        while len(eng.inbox) >= p.HEADER.size:
            try:
                op, rid, length = p.parse_header(bytes(eng.inbox[: p.HEADER.size]))
            except p.ProtocolError as e:  # framing lost: answer, then close this one
                eng.errors += 1
                self._send(eng, p.frame(p.ERROR, 0, str(e).encode()))
                self._flush(eng)
                self._drop(eng)
                return
            end = p.HEADER.size + length
            if len(eng.inbox) < end:
                return
            payload = bytes(eng.inbox[p.HEADER.size : end])
            del eng.inbox[:end]
            self._send(eng, self._handle(eng, op, rid, payload))
        self._flush(eng)

    def _send(self, eng: _Engine, data: bytes) -> None:
        eng.outbox += data

    def _flush(self, eng: _Engine) -> None:
        if eng.sock.fileno() not in self.engines:
            return
        try:
            while eng.outbox:
                n = eng.sock.send(eng.outbox)
                del eng.outbox[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(eng)
            return
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if eng.outbox else 0)
        if mask != eng.mask:  # an epoll_ctl only when it changes
            self._selector.modify(eng.sock, mask, eng)
            eng.mask = mask

    def _drop(self, eng: _Engine) -> None:
        """An engine is gone: its loads are unpinned, its stores completed as failed."""
        fd = eng.sock.fileno()
        if self.engines.pop(fd, None) is None:
            return
        pins = list(eng.pins.elements())
        if pins:
            self.manager.complete_load(pins)
        if eng.storing:
            self.manager.complete_store(list(eng.storing), False)
        eng.pins.clear()
        eng.storing.clear()
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(eng.sock)
        eng.sock.close()

    # ------------------------------------------------------------------ calls
    def _handle(self, eng: _Engine, op: int, rid: int, payload: bytes) -> bytes:
        eng.calls += 1
        try:
            return p.frame(op | p.REPLY, rid, self._call(eng, op, payload))
        except (p.ProtocolError, ValueError, TypeError, KeyError) as e:
            eng.errors += 1
            return p.frame(p.ERROR, rid, f"{p.OPS.get(op, op)}: {e}".encode())

    def _call(self, eng: _Engine, op: int, payload: bytes) -> bytes:
        m = self.manager
        if op == p.HELLO:
            hello = p.decode_json(payload)
            if not isinstance(hello, dict):
                raise p.ProtocolError("hello payload must be a JSON object")
            eng.name = str(hello.get("name", ""))[:200]
            return p.encode_json(self.describe())
        if op == p.STATUS:
            return p.encode_json(self.status())
        if op == p.COMPLETE_STORE:
            if len(payload) < 1:
                raise p.ProtocolError("complete_store needs a success byte and keys")
            keys, end = p.decode_keys(payload, 1)
            self._check_end(payload, end)
            unknown = [k.hex() for k in keys if k not in eng.storing]
            if unknown or len(set(keys)) != len(keys):
                raise ValueError(
                    f"keys {unknown[:4]} are not being stored by this engine (or repeat); "
                    "complete only the keys prepare_store gave it, once"
                )
            m.complete_store(keys, bool(payload[0]))
            eng.storing.difference_update(keys)
            if payload[0]:
                eng.stored_keys += len(keys)
            return b""
        keys, end = p.decode_keys(payload)
        if op == p.TOUCH:  # keys, then optionally one byte per key: reused (1) or not (0)
            rest = payload[end:]
            if rest and len(rest) != len(keys):
                raise p.ProtocolError(f"touch of {len(keys)} keys with {len(rest)} reused flags")
            if rest:
                m.touch(keys, [b != 0 for b in rest])
            else:
                m.touch(keys)
            return b""
        self._check_end(payload, end)
        if op == p.LOOKUP:
            n = m.lookup(keys)
            eng.lookups += 1
            eng.looked_up_keys += len(keys)
            eng.hit_keys += n or 0
            return struct.pack("<q", -1 if n is None else n)
        if op == p.PREPARE_LOAD:
            slots = m.prepare_load(keys)
            eng.pins.update(keys)
            eng.loaded_keys += len(keys)
            return p.encode_slots(list(slots))
        if op == p.COMPLETE_LOAD:
            need = Counter(keys)
            short = [k.hex() for k, c in need.items() if eng.pins[k] < c]
            if short:
                raise ValueError(
                    f"keys {short[:4]} are not being loaded by this engine (as often as given); "
                    "complete only the keys prepare_load pinned for it"
                )
            m.complete_load(keys)
            eng.pins.subtract(need)
            eng.pins += Counter()  # drop the zero counts
            return b""
        if op == p.PREPARE_STORE:
            out = m.prepare_store(keys)
            if out is None:
                return b"\x00"
            self.evictions += len(out.evicted_keys)
            eng.storing.update(out.keys_to_store)
            return (
                b"\x01"
                + p.encode_keys(list(out.keys_to_store))
                + p.encode_slots(list(out.block_ids))
                + p.encode_keys(list(out.evicted_keys))
            )
        raise p.ProtocolError(f"unknown op {op}")

    @staticmethod
    def _check_end(payload: bytes, end: int) -> None:
        if end != len(payload):
            raise p.ProtocolError(f"{len(payload) - end} bytes after the key list")

    # ------------------------------------------------------------------ status
    def describe(self) -> dict[str, Any]:
        """What an engine needs to attach: the region, its inode and layout, the policy."""
        return {
            "version": p.VERSION,
            "region": self.region,
            "inode": getattr(self.pool, "inode", None),
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
            "policy": self.policy,
            "pid": os.getpid(),
        }

    def status(self) -> dict[str, Any]:
        """Blocks, engines attached, hit rates, evictions (``kvoff pool status``)."""
        m = self.manager
        looked = sum(e.looked_up_keys for e in self.engines.values())
        hits = sum(e.hit_keys for e in self.engines.values())
        return {
            **self.describe(),
            "uptime_s": round(time.time() - self.started, 3),
            "stored_blocks": m.num_stored_blocks,
            "free_blocks": m.num_free_blocks,
            "pending_blocks": m.num_pending_blocks,
            "evictable_blocks": m.num_evictable_blocks,
            "evictions": self.evictions,
            "engines_attached": len(self.engines),
            "engines_seen": self.engines_seen,
            "connections_refused": self.refused,
            "hit_rate": hits / looked if looked else 0.0,
            "engines": [
                {
                    "name": e.name,
                    "pid": e.pid,
                    "uid": e.uid,
                    "calls": e.calls,
                    "lookups": e.lookups,
                    "looked_up_blocks": e.looked_up_keys,
                    "hit_blocks": e.hit_keys,
                    "hit_rate": e.hit_keys / e.looked_up_keys if e.looked_up_keys else 0.0,
                    "stored_blocks": e.stored_keys,
                    "loaded_blocks": e.loaded_keys,
                    "pinned_blocks": sum(e.pins.values()),
                    "storing_blocks": len(e.storing),
                    "errors": e.errors,
                }
                for e in self.engines.values()
            ],
        }
