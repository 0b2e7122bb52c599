"""The shared tier on a Redis Cluster, and a throwaway local cluster for tests and benchmarks.

:class:`RedisClusterTier` keeps one Redis string per block::

    key   = f"{namespace}:{fingerprint.hex()}:{offload_key.hex()}"   (the fingerprint covers rank)
    value = block header (HEADER_BYTES) + payload                     (kvoff.tiers.block_format)

so engines of the same model and layout share blocks, and engines of another layout never see
them. With a ``shared_secret`` in the tier's :class:`~kvoff.tiers.block_format.BlockFormat`,
every value carries a MAC over its header, key and payload; anyone who can write the namespace
but lacks the secret can plant values, but they are misses (``unauthenticated_blocks``),
deleted, never served.

After :meth:`RedisClusterTier.clear` (a cache reset, say for new weights) the tier uses a
key space of its own, ``{namespace}:{fingerprint}.{salt}:`` with a random salt, so blocks made
before the reset are never read again.

Everything on the wire is redis-py: the cluster client (:class:`redis.cluster.RedisCluster`)
discovers the nodes and the slot map (``CLUSTER SLOTS``); the tier routes each key with
redis-py's ``key_slot`` (CRC16 mod 16384, the Redis Cluster spec) to the master of its slot and
pipelines each master's commands (``EXISTS`` / ``GET`` / ``SET ... PX`` / ``DEL``, at most
``max_batch`` keys per round trip, gets and puts ``max_batch_values`` keys or ``max_batch_bytes``
of values) on one of redis-py's pooled
connections to that node: redis-py packs and sends them together and parses each reply. The
masters of one batch are served in parallel from a thread pool.

Failure model: a node that refuses connections, resets them, or does not answer within
``timeout_s`` (redis-py ``socket_timeout`` / ``socket_connect_timeout``; no retries: the node
clients run with ``Retry(NoBackoff(), 0)``) fails only its own keys: ``get``/``contains`` answer
False, ``put`` drops and counts, nothing raises. The node then sits out a ``cooldown_s``
cool-down (its keys miss at once, ``stats()["node_skips"]``) and the slot map is refreshed in the
background (a failover may have moved its slots). A timed-out call is counted in ``timeouts``.
Redirections (MOVED / ASK / TRYAGAIN during resharding, CLUSTERDOWN), OOM and other per-key
errors are misses too; a redirection also reloads the slot map in the background.

Eviction is left to Redis: run the cluster with ``maxmemory <bytes>`` and
``maxmemory-policy allkeys-lru`` (or ``allkeys-lfu``), and optionally a TTL (``ttl_s``: ``SET PX``).
For one lost master to lose only its own slots, set ``cluster-require-full-coverage no`` (and
``cluster-allow-reads-when-down yes``) on the servers; otherwise Redis answers CLUSTERDOWN for every
slot after ``cluster-node-timeout``, which the tier reports as misses.

:class:`LocalRedisCluster` starts ``redis-server`` processes in cluster mode on free localhost
ports in a temporary directory and joins them with ``redis-cli --cluster create``.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvoff._optional import extra_imports

with extra_imports("redis", "the Redis Cluster tier (remote_url, --remote-url)"):
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.connection import Connection, Encoder, PythonRespSerializer
    from redis.crc import key_slot
    from redis.exceptions import AskError, ClusterDownError, TryAgainError
    from redis.retry import Retry

from kvoff.tiers.base import (
    CallGate,
    SecondaryTier,
    TierStats,
    byte_view,
    check_batch,
    check_int,
    check_seconds,
    run_all,
)
from kvoff.tiers.block_format import HEADER_BYTES, BlockFormat, check_block, encode_header
from kvoff.tiers.cluster_url import check_timeout_s, check_ttl_s, parse_cluster_url

log = logging.getLogger("kvoff.tiers.redis")

_NODE_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
# Error replies that mean the slot map is stale: MOVED (MovedError subclasses AskError), ASK,
# TRYAGAIN, CLUSTERDOWN. redis-py strips the code from the message ("MOVED 3999 host:port"
# becomes MovedError("3999 host:port")), so they are told apart by type.
_REDIRECTIONS = (AskError, TryAgainError, ClusterDownError)
# A round trip of puts builds its values (header + payload per block) in one buffer that each
# sending thread keeps between calls (numpy.empty: not zero-filled) and sends them from there.
# A new bytearray per block was zero-filled, and its pages went back to the allocator and were
# faulted in again for every block (perf on the 2-core box, 64 KiB blocks: memset and page
# faults about 15 % of the client's time). The buffer bounds a round trip of puts: at least one
# block, else at most this many bytes of values.
PUT_BUFFER_BYTES = 8 << 20
_KEY_COMMANDS = {"get": b"GET", "exists": b"EXISTS", "del": b"DEL"}  # ops with no value
# the counter of a rejected value's reason (kvoff.tiers.block_format.check_block); every other
# reason is corrupted_blocks
_REASON_COUNTERS = {"fingerprint": "fingerprint_mismatches", "auth": "unauthenticated_blocks"}


class _Read(NamedTuple):
    """A GET reply that failed verification: the :func:`check_block` reason and the reply's
    length in bytes. (A valid reply's result is just its length, an int: no container object
    per block, see :meth:`RedisClusterTier.get`.)"""

    reason: str
    nbytes: int


class _SendFromBuffer(Connection):
    """A redis-py connection that sends large values straight from the caller's buffer.

    redis-py packs commands with hiredis when it is installed, and hiredis copies every value
    into a new bytes object: for a 2 MiB block that is a fresh allocation, and its page faults,
    per ``SET`` (measured on the 2-core box, 2026-11-24: 0.29 GB/s of puts at 2 MiB). redis-py's
    own packer passes a memoryview through as a separate chunk of the ``sendall`` list, so the
    payload goes from the block buffer to the socket with no copy. Replies are still parsed by
    hiredis. ``command_packer`` is a documented :class:`redis.connection.Connection` argument.
    """

    def __init__(self, **kwargs: Any) -> None:
        encoder = Encoder(
            kwargs.get("encoding", "utf-8"),
            kwargs.get("encoding_errors", "strict"),
            kwargs.get("decode_responses", False),
        )
        kwargs.setdefault("command_packer", PythonRespSerializer(6000, encoder.encode))
        super().__init__(**kwargs)


class RedisClusterTier(SecondaryTier):
    """Blocks shared through a Redis Cluster (see the module docstring for the key scheme).

    Args:
        url: ``redis://host:port`` of one or more cluster nodes (``rediss://`` for TLS;
            ``user:password@`` allowed).
        fmt: block format; its fingerprint is part of every key.
        namespace: key prefix (no spaces or ``:``).
        ttl_s: time to live of stored blocks in seconds (None: until Redis evicts them).
        timeout_s: per-node socket connect / read timeout in seconds; a node slower than this
            fails its keys of the call (a miss / a dropped write).
        max_batch: keys per pipeline round trip to one node for lookups and deletes.
        max_batch_values: keys per round trip of gets and puts, whose replies or commands carry
            whole blocks. 64 is the default from an A/B on a 16-core Xeon (the H200 machine,
            bench/results/gpu/h200-2026-11-27b/redis_variants.json): with 64 KiB blocks, 64 keys per
            round trip gave 1.10x the gets and 1.08x the puts of 256 (medians of 6 per-round
            ratios; 32 keys: 1.01x / 1.07x). Redis builds a pipeline's replies before it sends
            them, so a shorter round trip lets the client read one while the server builds the
            next. Serving one node's round trips on several connections at once was slower
            (0.74x / 0.79x): the client's threads then contend for the GIL.
        max_batch_bytes: value bytes per round trip (bounds memory; extra). Puts also send at
            most :data:`PUT_BUFFER_BYTES` of values per round trip (at least one block).
        cooldown_s: seconds a failed node's keys miss at once before it is tried again (extra).
        io_threads: threads serving the nodes of one batch in parallel (extra).
        socket_read_size: bytes read from a node's socket per ``recv`` (redis-py's
            ``socket_read_size``, whose default is 64 KiB); each connection holds one buffer
            of this size. hiredis appends each read to its own buffer and, after every reply
            it returns, moves the unread rest of that buffer to its front, so a read of R bytes
            holding replies of S < R bytes moves about R^2 / (2 S) bytes: 8 times the payload
            for 64 KiB blocks read 1 MiB at a time. 256 KiB is the default from an A/B on the
            2-core box (bench/results/tiers/ab-redis-read-size-2026-11-27.json,
            docs/tiers.md): against 1 MiB reads, gets 1.15x / 1.09x / 1.06x faster at 64 KiB /
            512 KiB / 2 MiB blocks (medians of 6 per-round ratios).

    Raises:
        TypeError: ``ttl_s``, ``timeout_s`` or ``cooldown_s`` not a number, or ``max_batch``,
            ``max_batch_values``, ``max_batch_bytes``, ``io_threads`` or ``socket_read_size``
            not an int (a bool is neither).
        ValueError: bad URL (see :func:`~kvoff.tiers.cluster_url.parse_cluster_url`) or
            namespace; ``ttl_s`` or ``timeout_s`` not finite and > 0, or above
            :data:`~kvoff.tiers.cluster_url.MAX_TTL_MS` ms / ``MAX_TIMEOUT_S``; ``cooldown_s``
            not finite and >= 0; ``max_batch``, ``max_batch_values`` or ``io_threads`` < 1;
            ``max_batch_bytes`` below one block object; ``socket_read_size`` < 4096. An
            unreachable cluster is not an error: the tier answers misses
            (``stats()["unavailable"] == 1``) and retries every ``cooldown_s``.
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        fmt: BlockFormat,
        *,
        namespace: str = "kvoff",
        ttl_s: float | None = None,
        timeout_s: float = 0.25,
        max_batch: int = 256,
        max_batch_values: int = 64,
        max_batch_bytes: int = 64 << 20,
        cooldown_s: float = 1.0,
        io_threads: int = 4,
        socket_read_size: int = 256 << 10,
    ) -> None:
        if not isinstance(fmt, BlockFormat):
            raise ValueError(f"fmt must be a kvoff.tiers.BlockFormat, got {fmt!r}")
        self.nodes, self._options = parse_cluster_url(url)
        if not namespace or any(c in namespace for c in " :\n\t"):
            raise ValueError(f"namespace={namespace!r} must be non-empty, without spaces or ':'")
        ttl_ms = check_ttl_s(ttl_s, "ttl_s")
        timeout = check_timeout_s(timeout_s, "timeout_s")
        max_batch = check_int(max_batch, "max_batch", minimum=1, hint="e.g. 256")
        max_batch_values = check_int(
            max_batch_values, "max_batch_values", minimum=1, hint="e.g. 64"
        )
        max_batch_bytes = check_int(
            max_batch_bytes,
            "max_batch_bytes",
            minimum=fmt.object_bytes,
            hint=f"at least one block object of {fmt.object_bytes} bytes; e.g. 64 MiB",
        )
        cooldown = check_seconds(cooldown_s, "cooldown_s", allow_zero=True, hint="e.g. 1.0")
        io_threads = check_int(io_threads, "io_threads", minimum=1, hint="e.g. 4")
        socket_read_size = check_int(
            socket_read_size, "socket_read_size", minimum=4096, hint="bytes, e.g. 256 KiB"
        )
        self.fmt = fmt
        self.url = url
        self.namespace = namespace
        self.prefix = f"{namespace}:{fmt.fingerprint.hex()}:".encode()
        self.clears = 0  # clear() calls: each one moved this tier to a fresh key space
        self.ttl_ms = ttl_ms
        self.timeout_s = timeout
        self.max_batch = max_batch
        self.max_batch_values = max_batch_values
        self.max_batch_bytes = max_batch_bytes
        self.cooldown_s = cooldown
        self.socket_read_size = socket_read_size
        self.error: str | None = None
        self._stats = TierStats(extra=("node_skips", "topology_refreshes", "unavailable"))
        self._lock = threading.Lock()
        self._gate = CallGate(self._lock)  # calls in flight (close waits for them)
        self._down_until: dict[str, float] = {}
        self._refreshing = False
        self._refresher: threading.Thread | None = None  # the slot-map reload (close joins it)
        self._next_connect = 0.0
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvoff-redis")
        self._local = threading.local()  # each sending thread's put buffer
        self._rc: RedisCluster | None = None
        self._table: tuple[Any, list[ClusterNode | None]] | None = None
        self._client()

    # ------------------------------------------------------------------ connection management

    def _connection_options(self) -> dict[str, Any]:
        """The startup nodes and connection options of the cluster client. Without TLS the
        nodes' connections are :class:`_SendFromBuffer` (values sent from the block buffers):
        redis-py builds node pools with a ``connection_class`` only when the client is given a
        ``url``, so the first node goes as the url and the others as startup nodes. With TLS,
        redis-py's own SSL connections (hiredis packing)."""
        opts: dict[str, Any] = dict(self._options)
        if opts.get("ssl"):
            return {"startup_nodes": [ClusterNode(h, p) for h, p in self.nodes], **opts}
        opts.pop("ssl", None)
        host, port = self.nodes[0]
        return {
            "url": f"redis://[{host}]:{port}" if ":" in host else f"redis://{host}:{port}",
            "startup_nodes": [ClusterNode(h, p) for h, p in self.nodes[1:]],
            "connection_class": _SendFromBuffer,
            **opts,
        }

    def _client(self) -> RedisCluster | None:
        """The cluster client, (re)connecting at most once per cool-down; None if unreachable."""
        rc = self._rc
        if rc is not None or self._gate.closed:
            return rc
        with self._lock:
            if self._rc is not None or time.monotonic() < self._next_connect:
                return self._rc
            self._next_connect = time.monotonic() + self.cooldown_s
        try:
            rc = RedisCluster(
                require_full_coverage=False,
                retry=Retry(NoBackoff(), 0),
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
                socket_keepalive=True,
                socket_read_size=self.socket_read_size,
                **self._connection_options(),
            )
        except Exception as e:  # redis-py raises several types for an unreachable cluster
            self.error = f"Redis Cluster at {self.url} unreachable: {type(e).__name__}: {e}"
            log.warning("%s; its keys miss, retrying every %.1f s", self.error, self.cooldown_s)
            self._stats.set(unavailable=1)
            return None
        with self._lock:
            if self._rc is None:
                self._rc, rc = rc, None
        if rc is not None:
            rc.close()
        self.error = None
        self._stats.set(unavailable=0)
        return self._rc

    def _node_failed(self, name: str) -> None:
        with self._lock:
            self._down_until[name] = time.monotonic() + self.cooldown_s
        self._request_refresh()

    def _request_refresh(self) -> None:
        """Reload the slot map in the background (one reload at a time; :meth:`close` waits
        for it). The thread is made and started under the lock, so that a ``close`` that
        took the lock after it finds it to join."""
        with self._lock:
            if self._refreshing or self._gate.closed:
                return
            self._refreshing = True
            self._refresher = threading.Thread(
                target=self._refresh, name="kvoff-redis-refresh", daemon=True
            )
            self._refresher.start()
        self._stats.add(topology_refreshes=1)

    def _refresh(self) -> None:
        """Reload the slot map (a failover may have moved the failed node's slots)."""
        try:
            rc = self._rc
            if rc is not None and not self._gate.closed:
                rc.nodes_manager.initialize()
        except Exception as e:  # any failure just leaves the old map
            log.debug("slot map refresh failed: %s", e)
        finally:
            with self._lock:
                self._refreshing = False

    def _slot_table(self, rc: RedisCluster) -> list[ClusterNode | None]:
        """Master of each of the 16384 slots, from redis-py's slot map; rebuilt whenever redis-py
        reloads the map (a routing lookup per key through ``get_node_from_slot`` costs more than
        the rest of a pipelined EXISTS)."""
        cache = rc.nodes_manager.slots_cache
        table = self._table
        if table is not None and table[0] is cache:
            return table[1]
        nodes: list[ClusterNode | None] = [None] * 16384
        for slot, owners in list(cache.items()):
            if owners:
                nodes[slot] = owners[0]  # the primary comes first
        self._table = (cache, nodes)
        return nodes

    def _rkey(self, key: bytes, prefix: bytes | None = None) -> bytes:
        return (self.prefix if prefix is None else prefix) + bytes(key).hex().encode()

    def node_of(self, key: bytes) -> str | None:
        """``host:port`` of the master serving ``key`` (for tests and diagnostics)."""
        rc = self._client()
        if rc is None:
            return None
        node = self._slot_table(rc)[key_slot(self._rkey(key))]
        return None if node is None else node.name

    # ------------------------------------------------------------------ batching

    def _run(
        self,
        op: str,
        keys: Sequence[bytes],
        fill: Callable[[int, np.ndarray], None] | None = None,
        on_value: Callable[[int, bytes], Any] | None = None,
        prefix: bytes | None = None,
    ) -> list[Any]:
        """Run ``op`` (get / exists / set / del) for every key; one result per key: the reply,
        or an Exception instance when the key's node failed or was skipped. ``fill(i, out)``
        (set) writes key ``i``'s value into ``out`` (``fmt.object_bytes`` uint8); the sending
        thread calls it right before the key's round trip, in its own put buffer
        (:data:`PUT_BUFFER_BYTES`). ``on_value(i, reply)``, when given, is called for every
        bytes reply in the thread that read it (the nodes' threads run it in parallel) and its
        return value is the result instead. ``prefix``: the key space to use (default: the
        current one, :attr:`prefix`), so that the calls of one method stay in one key space
        when a :meth:`clear` runs between them."""
        results: list[Any] = [None] * len(keys)
        rc = self._client()
        if rc is None:
            return [ConnectionError("cluster unreachable")] * len(keys)
        groups: dict[str, tuple[ClusterNode, list[int]]] = {}
        now = time.monotonic()
        skipped = 0
        table = self._slot_table(rc)
        if prefix is None:
            prefix = self.prefix  # read once: a clear() meanwhile moves the next call only
        rkeys = [self._rkey(key, prefix) for key in keys]  # each made once: routed, then sent
        for i, rkey in enumerate(rkeys):
            node = table[key_slot(rkey)]
            if node is None:
                results[i] = ConnectionError("slot not covered by the cluster")
                continue
            if self._down_until.get(node.name, 0.0) > now:
                results[i] = ConnectionError(f"{node.name} cooling down")
                skipped += 1
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        if skipped:
            self._stats.add(node_skips=skipped)
        tasks = [(node, idx, op, rkeys, fill, results, on_value) for node, idx in groups.values()]
        if len(tasks) == 1:
            self._node_task(*tasks[0])
        elif tasks:
            run_all(self._pool, self._node_task, tasks)  # all finish before any error is raised
        return results

    def _chunks(self, idx: list[int], op: str) -> list[list[int]]:
        """``idx`` cut into round trips: gets and puts at most ``max_batch_values`` keys and
        ``max_batch_bytes`` of values (puts also :data:`PUT_BUFFER_BYTES`), lookups and deletes
        at most ``max_batch`` keys; at least one key each."""
        if op == "set":
            count, limit = self.max_batch_values, min(self.max_batch_bytes, PUT_BUFFER_BYTES)
        elif op == "get":
            count, limit = self.max_batch_values, self.max_batch_bytes
        else:
            return [idx[i : i + self.max_batch] for i in range(0, len(idx), self.max_batch)]
        step = max(1, min(count, limit // self.fmt.object_bytes))
        return [idx[i : i + step] for i in range(0, len(idx), step)]

    def _put_buffer(self) -> np.ndarray:
        """This thread's buffer for a round trip's values (made on its first put)."""
        buf: np.ndarray | None = getattr(self._local, "put_buffer", None)
        if buf is None:
            buf = np.empty(max(PUT_BUFFER_BYTES, self.fmt.object_bytes), np.uint8)
            self._local.put_buffer = buf
        return buf

    def _commands(
        self,
        op: str,
        chunk: list[int],
        rkeys: list[bytes],
        fill: Callable[[int, np.ndarray], None] | None,
    ) -> Iterator[tuple[Any, ...]]:
        """The commands of one round trip, one per key of ``chunk``, made one at a time as
        ``pack_commands`` packs them (a command tuple lives only until it is packed; command
        names are bytes, which redis-py's packer takes as they are). Puts build their values in
        this thread's put buffer, which must not be written again before they are sent."""
        if op != "set":
            name = _KEY_COMMANDS[op]
            for i in chunk:
                yield (name, rkeys[i])
            return
        assert fill is not None
        ttl = () if self.ttl_ms is None else (b"PX", self.ttl_ms)
        buf, size = self._put_buffer(), self.fmt.object_bytes
        for n, i in enumerate(chunk):
            value = buf[n * size : (n + 1) * size]
            fill(i, value)
            yield (b"SET", rkeys[i], memoryview(value), *ttl)

    def _node_task(
        self,
        node: ClusterNode,
        idx: list[int],
        op: str,
        rkeys: list[bytes],
        fill: Callable[[int, np.ndarray], None] | None,
        results: list[Any],
        on_value: Callable[[int, bytes], Any] | None,
    ) -> None:
        """Serve one master's keys of a call: per chunk one round trip on one of the node's
        pooled redis-py connections (``pack_commands`` / ``send_packed_command``, then one
        ``read_response`` per command), which is what redis-py's non-transactional pipeline
        does without its per-command Python (command objects, response callbacks), and each
        reply is checked (``on_value``) and let go as it is read instead of after the whole
        round trip: in one A/B on the 2-core box, puts 1.28x faster at 64 KiB and gets 1.32x at
        2 MiB (docs/tiers.md). An error reply (ResponseError) fails its own key only; a
        redirection (MOVED, ASK, TRYAGAIN, CLUSTERDOWN) also reloads the slot map. A node that
        fails mid-round-trip fails the keys whose replies were not read yet (and the later
        round trips); the replies read before stand. A connection that fails or raises
        mid-reply is disconnected before it goes back to the pool, so no later call reads this
        call's replies."""
        client = node.redis_connection
        chunks = self._chunks(idx, op)
        for n, chunk in enumerate(chunks):
            done = 0  # keys of this chunk whose reply was read: their results stand
            try:
                if client is None:
                    raise ConnectionError(f"no client for {node.name}")
                pool = client.connection_pool
                conn = pool.get_connection()
                redirected = False
                try:
                    conn.send_packed_command(
                        conn.pack_commands(self._commands(op, chunk, rkeys, fill))
                    )
                    for i in chunk:
                        try:
                            reply = conn.read_response()
                        except redis.ResponseError as e:  # this key's error reply only
                            results[i] = e
                            redirected = redirected or isinstance(e, _REDIRECTIONS)
                            done += 1
                            continue
                        if on_value is not None and isinstance(reply, (bytes, bytearray)):
                            results[i] = on_value(i, reply)
                        else:
                            results[i] = reply
                        done += 1
                except BaseException:
                    conn.disconnect()  # replies may be left unread on it
                    raise
                finally:
                    pool.release(conn)
                if redirected:  # resharding or failover: these keys miss, the map is reloaded
                    self._request_refresh()
                continue
            except redis.TimeoutError as e:
                self._stats.add(timeouts=1)
                err: Exception = e
            except (*_NODE_ERRORS, redis.RedisError) as e:
                err = e
            # this node failed: its keys of this call whose reply was not read fail (a SET
            # acknowledged or a GET verified and copied before the failure stands), the node
            # cools down
            self._stats.add(io_errors=1)
            for i in chunk[done:]:
                results[i] = err
            for rest in chunks[n + 1 :]:
                for i in rest:
                    results[i] = err
            log.debug("node %s failed: %s", node.name, err)
            self._node_failed(node.name)
            return

    # ------------------------------------------------------------------ the tier interface

    def _enter(self) -> bool:
        """Count a call in flight (:meth:`close` waits for it before it shuts the node threads
        and the connections down); False once closed (the call answers misses)."""
        return self._gate.enter()

    def _exit(self) -> None:
        self._gate.exit()

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Pipelined EXISTS per key; False for keys of failed / slow nodes, all False once the
        tier is closed.

        Raises:
            ValueError: a key that is not bytes of 1..64 (nothing is looked up).
            TypeError: ``keys`` is not a list or tuple (a single key, None).
        """
        check_batch(keys)
        if not self._enter():
            return [False] * len(keys)
        try:
            found = [r == 1 for r in self._run("exists", keys)]
        finally:
            self._exit()
        self._stats.add(lookups=len(found), lookup_hits=sum(found))
        return found

    def get(self, keys: Sequence[bytes], outs: Sequence[np.ndarray]) -> list[bool]:
        """Pipelined GET, verified (header, fingerprint, key, length, checksum; with
        ``fmt.shared_secret`` the MAC first) and copied into ``outs``. A rejected value
        (corrupt, foreign, or unauthenticated: counted in ``unauthenticated_blocks``) is
        deleted from the cluster and counted, and never served.

        Each node's thread verifies and copies the values it read while the other nodes' replies
        are still arriving (``numpy.copyto`` and xxHash run without the GIL on whole blocks),
        and lets go of each reply at once. All False once the tier is closed.

        Raises:
            ValueError: a key that is not bytes of 1..64, an ``outs`` entry of the wrong size
                or read-only, or ``len(outs) != len(keys)`` (nothing is read).
            TypeError: ``keys`` or ``outs`` is not a list or tuple, or an entry of ``outs``
                is not a buffer.
        """
        check_batch(keys, outs, "outs")
        views = [byte_view(o, self.fmt.payload_bytes, "outs[i]", writable=True) for o in outs]
        if not self._enter():
            self._stats.add(misses=len(keys))
            return [False] * len(keys)
        try:
            return self._get(keys, views)
        finally:
            self._exit()

    def _get(self, keys: Sequence[bytes], views: list[memoryview]) -> list[bool]:
        """:meth:`get` of checked arguments, between ``_enter`` and ``_exit``."""
        fmt = self.fmt

        def verify_and_copy(i: int, reply: bytes) -> int | _Read:
            value = memoryview(reply)
            reason = check_block(fmt, bytes(keys[i]), value[:HEADER_BYTES], value[HEADER_BYTES:])
            if reason is not None:
                return _Read(reason, len(reply))
            np.copyto(
                np.frombuffer(views[i], np.uint8),
                np.frombuffer(reply, np.uint8, fmt.payload_bytes, HEADER_BYTES),
            )
            return len(reply)

        t0 = time.perf_counter()
        # one key space for the GET and the clean-up DEL: after a clear() in between, a DEL in
        # the new key space would delete a fresh, valid block there and leave the corrupt one
        prefix = self.prefix
        results = self._run("get", keys, on_value=verify_and_copy, prefix=prefix)
        served = [False] * len(keys)
        bad: list[bytes] = []
        counts = {"corrupted_blocks": 0, "fingerprint_mismatches": 0, "unauthenticated_blocks": 0}
        read = nbytes = 0
        for i, r in enumerate(results):
            if type(r) is int:  # verified and copied
                read += 1
                nbytes += r
                served[i] = True
            elif isinstance(r, _Read):
                read += 1
                nbytes += r.nbytes
                counts[_REASON_COUNTERS.get(r.reason, "corrupted_blocks")] += 1
                bad.append(bytes(keys[i]))
            # else a miss (None), or the node's error
        if bad:
            self._run("del", bad, prefix=prefix)
        hits = sum(served)
        self._stats.add(
            hits=hits,
            misses=len(keys) - hits,
            blocks_read=read,
            bytes_read=nbytes,
            read_seconds=time.perf_counter() - t0,
            **counts,
        )
        return served

    def put(self, keys: Sequence[bytes], payloads: Sequence[np.ndarray]) -> list[bool]:
        """Pipelined ``SET key header+payload [PX ttl]``; False (dropped, counted) for keys of
        failed / slow nodes and rejected writes (e.g. OOM without an eviction policy).

        Each value (header, then a copy of the payload) is made by the node thread that sends
        it, right before its round trip, in that thread's put buffer (:data:`PUT_BUFFER_BYTES`):
        the nodes' threads encode in parallel, and no value is allocated per block. All False
        (dropped) once the tier is closed.

        Raises:
            ValueError: a key that is not bytes of 1..64, a payload of the wrong size, or
                ``len(payloads) != len(keys)`` (nothing is written).
            TypeError: ``keys`` or ``payloads`` is not a list or tuple, or an entry of ``payloads``
                is not a buffer.
        """
        check_batch(keys, payloads, "payloads")
        views = [byte_view(p, self.fmt.payload_bytes, "payloads[i]") for p in payloads]
        if not self._enter():
            self._stats.add(writes_dropped=len(keys))
            return [False] * len(keys)
        try:
            return self._put(keys, views)
        finally:
            self._exit()

    def _put(self, keys: Sequence[bytes], views: list[memoryview]) -> list[bool]:
        """:meth:`put` of checked arguments, between ``_enter`` and ``_exit``."""
        fmt = self.fmt

        def fill(i: int, out: np.ndarray) -> None:
            # run by the thread that sends it, right before its round trip (node threads run
            # in parallel; numpy.copyto and xxHash of a whole block run without the GIL)
            header = encode_header(fmt, bytes(keys[i]), views[i], stamp=time.time_ns())
            out[:HEADER_BYTES] = np.frombuffer(header, np.uint8)
            np.copyto(out[HEADER_BYTES:], np.frombuffer(views[i], np.uint8))

        t0 = time.perf_counter()
        stored = [r in (b"OK", "OK") for r in self._run("set", keys, fill)]
        n = sum(stored)
        self._stats.add(
            blocks_written=n,
            bytes_written=n * self.fmt.object_bytes,
            writes_dropped=len(keys) - n,
            write_seconds=time.perf_counter() - t0,
        )
        return stored

    def evict(self, keys: Sequence[bytes]) -> int:
        """Pipelined DEL; returns how many keys existed (keys of failed nodes count as absent;
        0 once the tier is closed).

        Raises:
            ValueError: a key that is not bytes of 1..64 (nothing is deleted).
            TypeError: ``keys`` is not a list or tuple (a single key, None).
        """
        check_batch(keys)
        if not self._enter():
            return 0
        try:
            removed = sum(1 for r in self._run("del", keys) if r == 1)
        finally:
            self._exit()
        self._stats.add(evictions=removed)
        return removed

    def clear(self) -> int:
        """Forgets every block stored before the call (:meth:`SecondaryTier.clear`) without
        deleting any: the cluster's blocks are other engines' too, and engines that did not
        reset still use theirs. From now on this tier reads and writes a key space of its own,
        ``{namespace}:{fingerprint}.{salt}:``, with a fresh random 64-bit salt, so no block
        written before (by this engine or another) is ever read again, and this engine no
        longer shares blocks with the others until it restarts. The old blocks stay until
        their TTL (``ttl_s``) ends or Redis evicts them (``maxmemory-policy allkeys-lru``).
        Calls already running finish in the old key space. Returns 0 (the shared store cannot
        count what it forgot)."""
        salt = os.urandom(8).hex()
        with self._lock:
            self.prefix = f"{self.namespace}:{self.fmt.fingerprint.hex()}.{salt}:".encode()
            self.clears += 1
        return 0

    def stats(self) -> dict[str, int | float]:
        """Counters of :data:`kvoff.tiers.base.STAT_KEYS` plus ``node_skips`` (keys that missed
        at once because their node was cooling down), ``topology_refreshes`` and ``unavailable``
        (1 while no node of the cluster answers). ``timeouts`` counts node round trips that ran
        into ``timeout_s``; ``io_errors`` counts every failed node round trip."""
        return self._stats.snapshot()

    def close(self) -> None:
        """Wait for the calls in flight and for a slot-map reload in flight (each ends within
        its nodes' ``timeout_s`` seconds), then close the node threads and the connections;
        later calls miss / drop. Idempotent."""
        self._gate.close()  # calls from now on answer misses at once
        with self._lock:  # no reload starts from now on (_request_refresh checks the gate)
            refresher = self._refresher
        if refresher is not None:
            # a reload in flight works on the client's node connections; it ends within its
            # nodes' socket timeouts (timeout_s each)
            refresher.join()
        with self._lock:
            rc, self._rc = self._rc, None
        self._pool.shutdown(wait=True)
        self._table = None  # it holds the node objects (and so their connection pools)
        if rc is not None:
            nodes = rc.get_nodes()
            rc.close()
            # redis-py makes the node clients with auto_close_connection_pool=False, so
            # RedisCluster.close() leaves one open socket per node: disconnect them here
            for node in nodes:
                client = node.redis_connection
                if client is not None:
                    client.connection_pool.disconnect()


# ---------------------------------------------------------------------- local cluster for tests


def redis_server_skip_reason() -> str | None:
    """Why a local Redis Cluster cannot be started here (None when it can)."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        return (
            f"{' and '.join(missing)} not found: install Redis 7 (Debian: apt-get install "
            f"redis-server; `bash .ci/setup` does it)"
        )
    return None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int) -> list[int]:
    """``n`` ports P with P and its cluster bus port P + 10000 free on 127.0.0.1."""
    rng = random.Random(os.getpid() ^ time.time_ns())
    ports: list[int] = []
    while len(ports) < n:
        p = rng.randrange(20000, 40000)
        if p not in ports and _port_free(p) and _port_free(p + 10000):
            ports.append(p)
    return ports


class LocalRedisCluster:
    """A Redis Cluster of ``masters`` redis-server processes on 127.0.0.1, no replicas.

    Each node runs in cluster mode with no persistence (``--save ""``, ``--appendonly no``),
    ``--enable-debug-command yes`` (tests send ``DEBUG SLEEP``), ``--maxmemory`` with
    ``allkeys-lru``, and ``cluster-require-full-coverage no`` so a killed master loses only its
    own slots. Use as a context manager; :meth:`kill` SIGKILLs one master.

    Args:
        masters: number of masters (>= 3, as redis-cli requires).
        maxmemory: per-node ``maxmemory`` (Redis syntax, e.g. ``"256mb"``).
        directory: where node files and logs go (a fresh temporary directory if None; removed
            by :meth:`stop` only if created here).
        startup_timeout_s: seconds to wait for the servers and for ``cluster_state:ok``.

    Raises:
        RuntimeError (from :meth:`start`): redis-server / redis-cli missing or the cluster did
            not come up (the message includes the tail of the node logs).
    """

    def __init__(
        self,
        masters: int = 3,
        *,
        maxmemory: str = "256mb",
        directory: str | Path | None = None,
        startup_timeout_s: float = 30.0,
    ) -> None:
        self.masters = masters
        self.maxmemory = maxmemory
        self._own_dir = directory is None
        self.directory = Path(directory) if directory else None
        self.startup_timeout_s = startup_timeout_s
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:P`` of the first master."""
        return f"redis://127.0.0.1:{self.ports[0]}"

    def client(self, index: int, **kwargs: Any) -> redis.Redis:
        """A plain redis-py client of node ``index``."""
        return redis.Redis(host="127.0.0.1", port=self.ports[index], **kwargs)

    def index_of(self, node_name: str) -> int:
        """The node index of ``"127.0.0.1:P"``."""
        return self.ports.index(int(node_name.rsplit(":", 1)[1]))

    def start(self) -> LocalRedisCluster:
        """Start the servers, create the cluster, wait for ``cluster_state:ok`` everywhere.

        Raises:
            RuntimeError: ``redis-server`` or ``redis-cli`` is missing (the reason says how to
                install them), or the cluster did not come up within ``startup_timeout_s``
                (with the servers' log tails); the servers started are stopped first.
        """
        reason = redis_server_skip_reason()
        if reason:
            raise RuntimeError(reason)
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="kvoff-redis-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ports = _free_ports(self.masters)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            for p in self.ports:
                self.procs.append(self._start_node(p))
            for i in range(self.masters):
                self._wait(lambda i=i: self.client(i, socket_timeout=1).ping(), deadline)
            addrs = [f"127.0.0.1:{p}" for p in self.ports]
            subprocess.run(
                [
                    "redis-cli",
                    "--cluster",
                    "create",
                    *addrs,
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=max(1.0, deadline - time.monotonic()),
            )
            for i in range(self.masters):
                self._wait(lambda i=i: self._node_ok(i), deadline)
        except BaseException as e:
            logs = self._log_tail()
            self.stop()
            if isinstance(e, Exception):
                raise RuntimeError(f"local Redis Cluster did not start: {e}\n{logs}") from e
            raise
        return self

    def _start_node(self, port: int) -> subprocess.Popen[bytes]:
        assert self.directory is not None
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
        args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
        args += ["--dir", str(self.directory), "--save", "", "--appendonly", "no"]
        args += ["--enable-debug-command", "yes", "--maxmemory", self.maxmemory]
        args += ["--maxmemory-policy", "allkeys-lru", "--cluster-require-full-coverage", "no"]
        args += ["--cluster-allow-reads-when-down", "yes", "--cluster-node-timeout", "5000"]
        args += ["--logfile", f"redis-{port}.log", "--daemonize", "no"]
        return subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.directory
        )

    def _node_ok(self, index: int) -> bool:
        info = self.client(index, socket_timeout=1).cluster("INFO")
        if isinstance(info, (bytes, str)):
            text = info.decode() if isinstance(info, bytes) else info
            info = dict(line.split(":", 1) for line in text.split() if ":" in line)
        return (
            str(info.get("cluster_state")) == "ok"
            and int(info.get("cluster_slots_ok", 0)) == 16384
            and int(info.get("cluster_known_nodes", 0)) == self.masters
        )

    def _wait(self, probe: Any, deadline: float) -> None:
        while True:
            try:
                if probe():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("timed out waiting for the Redis Cluster")
            time.sleep(0.05)

    def _log_tail(self) -> str:
        if self.directory is None:
            return ""
        out = []
        for p in self.ports:
            log_file = self.directory / f"redis-{p}.log"
            if log_file.exists():
                out.append(
                    f"--- redis-{p}.log\n" + "\n".join(log_file.read_text().splitlines()[-8:])
                )
        return "\n".join(out)

    def kill(self, index: int) -> None:
        """SIGKILL master ``index`` (its slots stay uncovered: there are no replicas)."""
        proc = self.procs[index]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self) -> None:
        """Stop every server and remove the directory if this object created it."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        if self._own_dir and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
