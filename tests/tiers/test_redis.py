"""The shared tier on a Redis Cluster (kvoff.tiers.redis_cluster.RedisClusterTier), against real
local 3-master clusters: round trip, a second process, a killed master, a slow node."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter

import numpy as np
import pydantic
import pytest

from kvoff.config import OffloadingConfig
from kvoff.tiers.block_format import HEADER_BYTES, BlockFormat, layout_fingerprint
from kvoff.tiers.cluster_url import MAX_TIMEOUT_S, MAX_TTL_MS
from kvoff.tiers.coordinator import tiers_from_config
from kvoff.tiers.redis_cluster import LocalRedisCluster, RedisClusterTier, parse_cluster_url

FP = layout_fingerprint(model="tiny", dtype="float16", world_size=2, rank=0, block_size=16)
FMT = BlockFormat(FP, 20000)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def block(k: bytes, fmt: BlockFormat = FMT) -> np.ndarray:
    seed = int.from_bytes(k[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, fmt.payload_bytes, dtype=np.uint8)


def count_sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets one item per round trip the tier sends on a node connection (every
    ``send_packed_command``, connection setup included)."""
    from kvoff.tiers.redis_cluster import _SendFromBuffer

    sends: list[int] = []
    real_send = _SendFromBuffer.send_packed_command

    def counting(self: _SendFromBuffer, command: object, check_health: bool = True) -> None:
        sends.append(1)
        real_send(self, command, check_health)

    monkeypatch.setattr(_SendFromBuffer, "send_packed_command", counting)
    return sends


def outs(n: int) -> list[np.ndarray]:
    return [np.zeros(FMT.payload_bytes + 3, np.uint8)[3:] for _ in range(n)]


def test_round_trip_over_three_masters(redis_url: str, redis_cluster: LocalRedisCluster) -> None:
    keys = [key(i) for i in range(60)]
    with RedisClusterTier(redis_url, FMT) as tier:
        assert tier.put(keys, [block(k) for k in keys]) == [True] * 60
        per_node = Counter(tier.node_of(k) for k in keys)
        assert len(per_node) == 3, per_node  # keys spread over all three masters
        assert [redis_cluster.client(i).dbsize() for i in range(3)] == [
            per_node[f"127.0.0.1:{p}"] for p in redis_cluster.ports
        ]
        absent = key(1000)
        assert tier.contains([*keys, absent]) == [True] * 60 + [False]
        bufs = outs(61)
        assert tier.get([*keys, absent], bufs) == [True] * 60 + [False]
        for k, b in zip(keys, bufs, strict=False):
            np.testing.assert_array_equal(b, block(k))
        # another layout (here: another rank) shares the cluster but never sees these blocks
        other = BlockFormat(layout_fingerprint(model="tiny", rank=1), FMT.payload_bytes)
        with RedisClusterTier(redis_url, other) as tier1:
            assert tier1.contains(keys[:5]) == [False] * 5
        assert tier.evict([*keys[:10], absent]) == 10
        assert tier.contains(keys[:12]) == [False] * 10 + [True] * 2
        s = tier.stats()
        assert (s["hits"], s["misses"], s["blocks_written"], s["evictions"]) == (60, 1, 60, 10)
        assert s["bytes_written"] == 60 * (HEADER_BYTES + FMT.payload_bytes)
        assert s["corrupted_blocks"] == s["timeouts"] == s["io_errors"] == 0


def test_batches_that_are_no_lists_are_named_and_send_nothing(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """'int' object is not iterable, or a bytes key read as a list of ints, before."""
    with RedisClusterTier(redis_url, FMT) as tier:
        assert tier.put([key(1)], [block(key(1))]) == [True]
        sends = count_sends(monkeypatch)
        keys_msg = r"keys must be a list or tuple of offload keys \(bytes\), got "
        for bad, shown in ((key(2), "bytes"), (None, "NoneType"), (7, "int")):
            with pytest.raises(TypeError, match=keys_msg + shown):
                tier.contains(bad)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=keys_msg + shown):
                tier.evict(bad)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=keys_msg + shown):
                tier.get(bad, outs(1))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"payloads must be a list or tuple of buffers"):
            tier.put([key(2)], block(key(2)))  # type: ignore[arg-type]
        with pytest.raises(
            TypeError,
            match=r"outs\[i\] must be a uint8 numpy array or a "
            r"bytes-like object of 20000 bytes, got NoneType",
        ):
            tier.get([key(1)], [None])  # type: ignore[list-item]
        assert sends == []  # refused before any round trip
        assert tier.contains([key(1), key(2)]) == [True, False]


def test_values_are_sent_from_the_block_buffer(redis_url: str) -> None:
    """Every master's connections pack a SET's value as the caller's memoryview (no copy into a
    new bytes object, which cost a fresh allocation per block with hiredis's packer)."""
    from kvoff.tiers.redis_cluster import _SendFromBuffer

    with RedisClusterTier(redis_url, FMT) as tier:
        rc = tier._client()
        assert rc is not None
        nodes = rc.get_primaries()
        assert len(nodes) == 3
        for node in nodes:
            pool = node.redis_connection.connection_pool
            assert pool.connection_class is _SendFromBuffer
            conn = pool.get_connection()
            try:
                value = memoryview(bytearray(FMT.object_bytes))
                assert any(chunk is value for chunk in conn.pack_command("SET", b"k", value))
            finally:
                pool.release(conn)
        keys = [key(i) for i in range(7)]
        assert tier.put(keys, [block(k) for k in keys]) == [True] * 7
        bufs = outs(7)
        assert tier.get(keys, bufs) == [True] * 7
        assert all(np.array_equal(b, block(k)) for b, k in zip(bufs, keys, strict=True))


def test_values_are_made_and_checked_in_the_node_threads(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put over several masters encodes each value in the thread that sends it, and a get
    verifies and copies each value in the thread that read it (the nodes' threads overlap this
    with the other nodes' traffic), byte-exact; the node connections read with the tier's
    socket_read_size."""
    import kvoff.tiers.redis_cluster as redis_cluster_module

    threads: dict[str, list[str]] = {"encode_header": [], "check_block": []}
    for name in threads:
        real = getattr(redis_cluster_module, name)

        def spy(*args: object, _real: object = real, _name: str = name, **kw: object) -> object:
            threads[_name].append(threading.current_thread().name)
            return _real(*args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(redis_cluster_module, name, spy)
    keys = [key(i) for i in range(60)]
    with RedisClusterTier(redis_url, FMT, socket_read_size=256 << 10) as tier:
        rc = tier._client()
        assert rc is not None
        for node in rc.get_primaries():
            kwargs = node.redis_connection.connection_pool.connection_kwargs
            assert kwargs["socket_read_size"] == 256 << 10
        assert tier.put(keys, [block(k) for k in keys]) == [True] * 60
        assert len({tier.node_of(k) for k in keys}) == 3
        bufs = outs(60)
        assert tier.get(keys, bufs) == [True] * 60
        for k, b in zip(keys, bufs, strict=True):
            np.testing.assert_array_equal(b, block(k))
        assert tier.stats()["bytes_read"] == 60 * FMT.object_bytes
    for name, seen in threads.items():
        assert len(seen) == 60, name
        assert all(t.startswith("kvoff-redis") for t in seen), (name, Counter(seen))
    with pytest.raises(ValueError, match="socket_read_size=1000"):
        RedisClusterTier(redis_url, FMT, socket_read_size=1000)
    with pytest.raises(ValueError, match="max_batch_values=0"):
        RedisClusterTier(redis_url, FMT, max_batch_values=0)


def test_puts_are_built_in_a_kept_buffer_and_sent_in_bounded_round_trips(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put's values are built in the sending thread's put buffer (one per thread, kept
    between calls, no allocation per block) and a round trip sends at most PUT_BUFFER_BYTES of
    them, so the buffer is rewritten only after its values went out: many round trips per
    master still read back byte-exact, in several calls."""
    import kvoff.tiers.redis_cluster as redis_cluster_module

    monkeypatch.setattr(redis_cluster_module, "PUT_BUFFER_BYTES", 3 * FMT.object_bytes + 7)
    sends = count_sends(monkeypatch)
    keys = [key(i) for i in range(60)]
    with RedisClusterTier(redis_url, FMT) as tier:
        for part in (keys[:45], keys[45:]):
            assert tier.put(part, [block(k) for k in part]) == [True] * len(part)
        assert len(sends) >= 60 // 3  # at most 3 values per round trip
        assert tier._put_buffer() is tier._put_buffer()  # kept, not made per call
        assert tier._put_buffer().nbytes == 3 * FMT.object_bytes + 7
        bufs = outs(60)
        assert tier.get(keys, bufs) == [True] * 60
        for k, b in zip(keys, bufs, strict=True):
            np.testing.assert_array_equal(b, block(k))
        assert tier.stats()["corrupted_blocks"] == 0


def test_small_batches_and_ttl(
    redis_url: str, redis_cluster: LocalRedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gets and puts go in round trips of at most max_batch_values keys, lookups and deletes
    of at most max_batch keys (counted per node connection send), and still read back
    byte-exact."""
    sends = count_sends(monkeypatch)
    keys = [key(i) for i in range(20)]
    with RedisClusterTier(
        redis_url, FMT, ttl_s=30, max_batch=10, max_batch_values=3, namespace="t"
    ) as tier:
        per_node = Counter(tier.node_of(k) for k in keys)
        values_trips = sum(-(-n // 3) for n in per_node.values())
        keys_trips = sum(-(-n // 10) for n in per_node.values())
        assert values_trips > keys_trips  # the two limits are told apart
        assert all(tier.put(keys, [block(k) for k in keys]))  # connects to every node
        sends.clear()
        assert all(tier.put(keys, [block(k) for k in keys]))
        assert len(sends) == values_trips
        sends.clear()
        bufs = outs(20)
        assert all(tier.get(keys, bufs))
        assert len(sends) == values_trips
        for k, b in zip(keys, bufs, strict=True):
            np.testing.assert_array_equal(b, block(k))
        sends.clear()
        assert all(tier.contains(keys))
        assert len(sends) == keys_trips
        rkey = f"t:{FP.hex()}:{keys[0].hex()}".encode()
        node = redis_cluster.index_of(tier.node_of(keys[0]) or "")
        assert 0 < redis_cluster.client(node).pttl(rkey) <= 30_000


def test_the_longest_ttl_and_timeout_are_accepted_by_redis(
    redis_url: str, redis_cluster: LocalRedisCluster
) -> None:
    """The largest TTL and timeout the checks let through work against the real servers: a TTL
    of MAX_TTL_MS is stored by every SET PX (1e17 s, which Redis refused for every SET, is
    refused at construction instead), and a timeout of MAX_TIMEOUT_S still connects."""
    keys = [key(i) for i in range(12)]
    with RedisClusterTier(
        redis_url, FMT, ttl_s=MAX_TTL_MS / 1000, timeout_s=MAX_TIMEOUT_S, namespace="long"
    ) as tier:
        assert tier.ttl_ms == MAX_TTL_MS
        assert tier.put(keys, [block(k) for k in keys]) == [True] * 12
        assert tier.stats()["unavailable"] == 0 and tier.stats()["writes_dropped"] == 0
        rkey = f"long:{FP.hex()}:{keys[0].hex()}".encode()
        node = redis_cluster.index_of(tier.node_of(keys[0]) or "")
        assert redis_cluster.client(node).pttl(rkey) > MAX_TTL_MS - 60_000
        assert tier.contains(keys) == [True] * 12


BAD_SETTINGS = [
    ({"ttl_s": float("inf")}, ValueError, "ttl_s=inf must be a finite number of seconds"),
    ({"ttl_s": float("nan")}, ValueError, "ttl_s=nan must be a finite"),
    ({"ttl_s": 1e17}, ValueError, r"ttl_s=1e\+17 is 100000000000000000000 ms, longer than Redis"),
    ({"ttl_s": True}, TypeError, "ttl_s=True must be a number of seconds > 0, not a bool"),
    ({"ttl_s": "60"}, TypeError, "ttl_s='60' must be a number of seconds"),
    ({"timeout_s": float("inf")}, ValueError, "timeout_s=inf must be a finite number"),
    ({"timeout_s": 2e9}, ValueError, r"timeout_s=2000000000.0 must be .* <= 1e\+09"),
    ({"timeout_s": True}, TypeError, "timeout_s=True must be a number of seconds"),
    ({"timeout_s": "0.25"}, TypeError, "timeout_s='0.25' must be a number of seconds"),
    ({"cooldown_s": float("nan")}, ValueError, "cooldown_s=nan must be a finite number"),
    ({"cooldown_s": -1}, ValueError, "cooldown_s=-1 must be a finite number of seconds >= 0"),
    ({"io_threads": float("nan")}, TypeError, "io_threads=nan must be an int >= 1, not a float"),
    ({"io_threads": 2.5}, TypeError, "io_threads=2.5 must be an int"),
    ({"io_threads": True}, TypeError, "io_threads=True must be an int >= 1, not a bool"),
    ({"io_threads": 0}, ValueError, "io_threads=0 must be an int >= 1"),
    ({"max_batch": True}, TypeError, "max_batch=True must be an int"),
    ({"max_batch_values": 1.0}, TypeError, "max_batch_values=1.0 must be an int"),
    ({"max_batch_bytes": float("nan")}, TypeError, "max_batch_bytes=nan must be an int"),
    ({"max_batch_bytes": 100}, ValueError, "max_batch_bytes=100 must be an int >="),
    ({"socket_read_size": 65536.0}, TypeError, "socket_read_size=65536.0 must be an int"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_SETTINGS, ids=repr)
def test_bad_settings_are_refused_naming_the_value(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    """Before, io_threads=nan was accepted and hung every batch spanning two masters,
    ttl_s=inf raised a raw OverflowError, timeout_s=inf left the tier unavailable for good,
    ttl_s=1e17 had Redis refuse every SET, and bools passed as numbers. A refusal comes before
    any connection (nothing listens on port 1)."""
    with pytest.raises(error, match=message):
        RedisClusterTier("redis://127.0.0.1:1", FMT, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"remote_ttl_s": float("inf")}, "remote_ttl_s=inf must be a finite number of seconds"),
        ({"remote_ttl_s": 1e17}, "remote_ttl_s=1e\\+17 is 100000000000000000000 ms, longer"),
        ({"remote_timeout_s": float("inf")}, "remote_timeout_s=inf must be a finite number"),
        ({"remote_timeout_s": float("nan")}, "remote_timeout_s"),
    ],
    ids=repr,
)
def test_the_configuration_refuses_remote_settings_the_tier_would_refuse(
    kwargs: dict[str, float], message: str
) -> None:
    """The configuration names its own key (remote_ttl_s, not ttl_s), at load time rather than
    when the engine makes its tiers."""
    with pytest.raises(pydantic.ValidationError, match=message):
        OffloadingConfig(num_cpu_blocks=4, remote_url="redis://127.0.0.1:1", **kwargs)


def test_configured_remote_settings_at_the_bounds_make_a_tier(redis_url: str) -> None:
    cfg = OffloadingConfig(
        num_cpu_blocks=4,
        remote_url=redis_url,
        remote_ttl_s=MAX_TTL_MS / 1000,
        remote_timeout_s=MAX_TIMEOUT_S,
    )
    [tier] = tiers_from_config(cfg, FMT)
    try:
        assert tier.put([key(1)], [block(key(1))]) == [True]
    finally:
        tier.close()


def test_second_process_sees_the_first_process_blocks(redis_url: str) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(__file__.rsplit("/", 1)[0])!r})
        from test_redis import FMT, block, key
        from kvoff.tiers.redis_cluster import RedisClusterTier
        keys = [key(i) for i in range(40)]
        with RedisClusterTier({redis_url!r}, FMT) as tier:
            assert tier.put(keys, [block(k) for k in keys]) == [True] * 40
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    keys = [key(i) for i in range(40)]
    with RedisClusterTier(redis_url, FMT) as tier:
        bufs = outs(40)
        assert tier.get(keys, bufs) == [True] * 40
        for k, b in zip(keys, bufs, strict=True):
            np.testing.assert_array_equal(b, block(k))


def test_clear_moves_to_a_key_space_of_its_own_and_deletes_nothing(redis_url: str) -> None:
    """A reset on one engine: its tier never reads a block written before (by itself or by
    another engine), while another engine that did not reset still reads the shared blocks."""
    keys = [key(i) for i in range(6)]
    with (
        RedisClusterTier(redis_url, FMT, namespace="kvoff-clear") as mine,
        RedisClusterTier(redis_url, FMT, namespace="kvoff-clear") as other,
    ):
        assert mine.put(keys[:3], [block(k) for k in keys[:3]]) == [True] * 3
        assert other.put(keys[3:], [block(k) for k in keys[3:]]) == [True] * 3
        before = mine.prefix
        assert mine.clear() == 0 and mine.clears == 1
        assert mine.prefix != before and mine.prefix.startswith(
            b"kvoff-clear:" + FMT.fingerprint.hex().encode() + b"."
        )
        assert mine.contains(keys) == [False] * 6
        assert mine.get(keys, outs(6)) == [False] * 6
        assert other.contains(keys) == [True] * 6  # nothing was deleted
        assert mine.put(keys[:1], [block(keys[0])]) == [True]  # the new weights' block
        bufs = outs(1)
        assert mine.get(keys[:1], bufs) == [True]
        np.testing.assert_array_equal(bufs[0], block(keys[0]))
        mine.clear()
        assert mine.contains(keys[:1]) == [False]  # each clear starts a fresh key space
        other.evict(keys)
    mine.close()
    assert mine.clear() == 0  # closed: no error


def test_corrupt_value_is_a_counted_miss_and_deleted(
    redis_url: str, redis_cluster: LocalRedisCluster
) -> None:
    k = key(7)
    with RedisClusterTier(redis_url, FMT) as tier:
        tier.put([k], [block(k)])
        node = redis_cluster.client(redis_cluster.index_of(tier.node_of(k) or ""))
        rkey = tier._rkey(k)
        value = bytearray(node.get(rkey))
        value[HEADER_BYTES + 123] ^= 1
        node.set(rkey, bytes(value))
        buf = outs(1)
        assert tier.get([k], buf) == [False]
        assert tier.stats()["corrupted_blocks"] == 1
        assert node.exists(rkey) == 0  # dropped, never served again
        node.set(rkey, bytes(value[:-5]))  # a truncated value
        assert tier.get([k], outs(1)) == [False]
        assert tier.stats()["corrupted_blocks"] == 2


def test_bad_url_and_unreachable_cluster() -> None:
    for url in ("http://h:1", "redis://host", "redis://:7000", "127.0.0.1:7000", "redis://h:x"):
        with pytest.raises(ValueError, match="remote_url"):
            RedisClusterTier(url, FMT)
    nodes, opts = parse_cluster_url("rediss://u:p%40ss@h1:7000,h2:7001")
    assert nodes == [("h1", 7000), ("h2", 7001)]
    assert opts == {"ssl": True, "username": "u", "password": "p@ss"}
    with pytest.raises(ValueError, match="timeout_s"):
        RedisClusterTier("redis://127.0.0.1:7000", FMT, timeout_s=0)
    # nothing listens on port 1: misses and dropped writes, no exception
    with RedisClusterTier("redis://127.0.0.1:1", FMT, timeout_s=0.2) as tier:
        assert tier.stats()["unavailable"] == 1
        assert tier.put([key(1)], [block(key(1))]) == [False]
        assert tier.get([key(1)], outs(1)) == [False]
        assert tier.contains([key(1)]) == [False]
        assert tier.stats()["writes_dropped"] == 1


def test_a_url_with_spaces_or_port_0_is_refused() -> None:
    """The documented grammar is redis://host:port[,host:port...] with no spaces: before,
    "h1:7000, h2:7000" gave host ' h2' (a DNS lookup that fails, so that node never joined)
    and port 0 was taken. Refused, not stripped, with the node and the fix."""
    for url, needle in [
        ("redis://h1:7000, h2:7000", "node ' h2:7000' contains whitespace.*redis://h1:7000,h2"),
        ("redis://h1:7000 ,h2:7000", "node 'h1:7000 ' contains whitespace"),
        ("redis://h :7000", "node 'h :7000' contains whitespace"),
        ("redis://h:0", "node 'h:0' has port 0.*1..65535"),
        ("redis://h1:7000,h2:0", "node 'h2:0' has port 0"),
    ]:
        with pytest.raises(ValueError, match=f"remote_url='{re.escape(url)}': {needle}"):
            parse_cluster_url(url)
        with pytest.raises(pydantic.ValidationError, match="remote_url"):
            OffloadingConfig(num_cpu_blocks=4, remote_url=url)
    assert parse_cluster_url("redis://h1:7000,h2:65535")[0] == [("h1", 7000), ("h2", 65535)]


class CloseDuringRouting(RedisClusterTier):
    """The real tier, one call of which is held after routing its keys until close() has
    begun (and a little longer), so close() overlaps a call that has yet to use the node
    threads."""

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.hold = False
        self.held = threading.Event()

    def _slot_table(self, rc):  # type: ignore[no-untyped-def]
        table = super()._slot_table(rc)
        if self.hold:
            self.hold = False
            self.held.set()
            deadline = time.monotonic() + 10
            while not self._gate.closed and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.2)  # close() would have shut the node threads down by now
        return table


@pytest.mark.parametrize("op", ["contains", "get", "put", "evict"])
def test_close_during_a_call_never_raises(redis_url: str, op: str) -> None:
    """Before, close() shut the node threads down under a call in flight, and the call raised
    "RuntimeError: cannot schedule new futures after shutdown" into the engine's tier thread.
    close() now waits for the call, which ends normally; later calls answer misses."""
    keys = [key(i) for i in range(60)]  # over all three masters: served on the node threads
    tier = CloseDuringRouting(redis_url, FMT)
    assert tier.put(keys, [block(k) for k in keys]) == [True] * 60
    calls = {
        "contains": lambda: tier.contains(keys),
        "get": lambda: tier.get(keys, outs(60)),
        "put": lambda: tier.put(keys, [block(k) for k in keys]),
        "evict": lambda: tier.evict(keys),
    }
    result: dict[str, object] = {}

    def call() -> None:
        try:
            result["answer"] = calls[op]()
        except Exception as e:  # the bug: must not happen
            result["error"] = e

    tier.hold = True
    th = threading.Thread(target=call)
    th.start()
    assert tier.held.wait(10)
    tier.close()
    th.join(10)
    assert not th.is_alive()
    assert "error" not in result, result
    assert result["answer"] == (60 if op == "evict" else [True] * 60)  # finished before close
    assert tier.contains(keys) == [False] * 60  # closed: misses, no exception
    assert tier.get(keys[:2], outs(2)) == [False, False]
    assert tier.put(keys[:2], [block(k) for k in keys[:2]]) == [False, False]
    assert tier.evict(keys) == 0
    tier.close()  # idempotent


def test_close_disconnects_from_every_master(private_redis_cluster: LocalRedisCluster) -> None:
    """redis-py leaves the node clients' sockets open at RedisCluster.close(): a closed tier
    must not, even while the caller still holds it."""
    c = private_redis_cluster
    admin = [c.client(i) for i in range(c.masters)]

    def connected() -> list[set[int]]:
        """Per master, the ids of its client connections (a new connection gets a new id, so
        a connection of the fixture's start-up that closes meanwhile does not count)."""
        return [{int(cl["id"]) for cl in a.client_list()} for a in admin]

    before = connected()
    closed = []
    for _ in range(5):
        tier = RedisClusterTier(c.url, FMT)
        assert tier.put([key(i) for i in range(9)], [block(key(i)) for i in range(9)]) == [True] * 9
        # it did connect to the masters
        assert any(now - old for now, old in zip(connected(), before, strict=True))
        tier.close()
        closed.append(tier)  # still referenced: no garbage collector to close the sockets
    after = connected()
    assert all(now <= old for now, old in zip(after, before, strict=True)), (after, before)
    assert closed[0].contains([key(1)]) == [False]  # and a closed tier misses


def test_a_reply_handler_that_raises_leaves_no_reply_for_the_next_call(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replies are checked as they are read, so an exception while checking one (here a
    fault injected into check_block) leaves the rest of that round trip's replies unread:
    the connection must be dropped, not handed back to the pool, or the next call on it would
    take those replies for its own and serve one key's bytes as another's."""
    import kvoff.tiers.redis_cluster as redis_cluster_module

    keys = [key(i) for i in range(40)]
    with RedisClusterTier(redis_url, FMT, io_threads=1) as tier:
        assert tier.put(keys, [block(k) for k in keys]) == [True] * 40
        real = redis_cluster_module.check_block
        calls = [0]

        def failing(*args: object, **kw: object) -> object:
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("injected")
            return real(*args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(redis_cluster_module, "check_block", failing)
        with pytest.raises(RuntimeError, match="injected"):
            tier.get(keys, outs(40))
        monkeypatch.setattr(redis_cluster_module, "check_block", real)
        for _ in range(3):  # every pooled connection is used again
            assert tier.contains(keys[::-1]) == [True] * 40
            bufs = outs(40)
            assert tier.get(keys[::-1], bufs) == [True] * 40
            for k, b in zip(keys[::-1], bufs, strict=True):
                np.testing.assert_array_equal(b, block(k))
        assert tier.stats()["corrupted_blocks"] == 0


def test_a_moved_slot_is_a_miss_then_the_slot_map_is_reloaded(
    private_redis_cluster: LocalRedisCluster,
) -> None:
    """A slot that moves to another master (resharding, failover) answers MOVED from its old
    master: that key misses (its write is dropped), nothing raises, and the tier reloads the
    slot map, after which the key is written to and served by its new master. redis-py strips
    the code from the message (MovedError("3999 host:port")), so a check of the message's text
    never sees it; the tier tells redirections apart by type."""
    from redis.crc import key_slot

    c = private_redis_cluster
    keys = [key(i) for i in range(12)]
    tier = RedisClusterTier(c.url, FMT)
    try:
        assert tier.put(keys, [block(k) for k in keys]) == [True] * 12
        k = keys[0]
        slot = key_slot(tier._rkey(k))
        old = c.index_of(tier.node_of(k) or "")
        new = (old + 1) % c.masters
        assert tier.evict([k]) == 1
        admin = [c.client(i) for i in range(c.masters)]
        assert admin[old].execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
        new_id = admin[new].execute_command("CLUSTER", "MYID")
        for a in admin:  # an empty slot handed over on every node
            a.execute_command("CLUSTER", "SETSLOT", slot, "NODE", new_id)
        refreshes = tier.stats()["topology_refreshes"]
        # the tier still routes k to its old master, which answers MOVED: a dropped write
        assert tier.put([k], [block(k)]) == [False]
        assert tier.stats()["writes_dropped"] == 1 and tier.stats()["io_errors"] == 0
        deadline = time.monotonic() + 10
        while tier.node_of(k) != f"127.0.0.1:{c.ports[new]}" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tier.node_of(k) == f"127.0.0.1:{c.ports[new]}", "slot map not reloaded"
        assert tier.stats()["topology_refreshes"] > refreshes
        assert tier.put([k], [block(k)]) == [True]
        bufs = outs(12)
        assert tier.get(keys, bufs) == [True] * 12  # k from its new master, the rest as before
        for kk, b in zip(keys, bufs, strict=True):
            np.testing.assert_array_equal(b, block(kk))
        assert admin[new].exists(f"kvoff:{FP.hex()}:{k.hex()}".encode()) == 1
        assert tier.stats()["corrupted_blocks"] == 0
    finally:
        tier.close()


def test_killed_master_mid_replay(private_redis_cluster: LocalRedisCluster) -> None:
    """One master is SIGKILLed while another thread keeps reading and writing: its keys miss
    (or are dropped), the other masters keep serving, nothing raises, nothing corrupt."""
    cluster = private_redis_cluster
    keys = [key(i) for i in range(48)]
    tier = RedisClusterTier(cluster.url, FMT, timeout_s=0.25)
    assert all(tier.put(keys, [block(k) for k in keys]))
    owner = {k: tier.node_of(k) for k in keys}
    victim = owner[keys[0]]
    assert victim is not None
    errors: list[BaseException] = []
    rounds = [0]
    killed = threading.Event()
    after_kill = threading.Event()

    def replay() -> None:
        try:
            while not after_kill.is_set():
                bufs = outs(len(keys))
                got = tier.get(keys, bufs)
                for k, b, ok in zip(keys, bufs, got, strict=True):
                    if ok:
                        np.testing.assert_array_equal(b, block(k))
                tier.put(keys[:8], [block(k) for k in keys[:8]])
                rounds[0] += 1
                if killed.is_set() and rounds[0] > 20:
                    after_kill.set()
        except BaseException as e:
            errors.append(e)
            after_kill.set()

    thread = threading.Thread(target=replay)
    thread.start()
    while rounds[0] < 5 and thread.is_alive():
        time.sleep(0.01)
    cluster.kill(cluster.index_of(victim))
    rounds[0] = 0
    killed.set()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert not errors, errors

    bufs = outs(len(keys))
    t0 = time.monotonic()
    got = tier.get(keys, bufs)
    assert time.monotonic() - t0 < 2.0
    assert got == [owner[k] != victim for k in keys]
    for k, b, ok in zip(keys, bufs, got, strict=True):
        if ok:
            np.testing.assert_array_equal(b, block(k))
    assert tier.contains(keys) == got
    stored = tier.put(keys, [block(k) for k in keys])
    assert stored == got
    s = tier.stats()
    assert s["corrupted_blocks"] == 0 and s["io_errors"] >= 1
    assert s["writes_dropped"] >= sum(1 for ok in got if not ok)
    tier.close()


def test_slow_node_times_out_into_a_miss(redis_url: str, redis_cluster: LocalRedisCluster) -> None:
    keys = [key(i) for i in range(30)]
    timeout_s = 0.25
    tier = RedisClusterTier(redis_url, FMT, timeout_s=timeout_s, cooldown_s=0.5)
    assert all(tier.put(keys, [block(k) for k in keys]))
    slow = tier.node_of(keys[0])
    expected = [tier.node_of(k) != slow for k in keys]
    sleeper = threading.Thread(
        target=lambda: redis_cluster.client(redis_cluster.index_of(slow or "")).execute_command(
            "DEBUG", "SLEEP", "1.5"
        )
    )
    sleeper.start()
    time.sleep(0.2)  # the node is now asleep
    try:
        bufs = outs(30)
        t0 = time.monotonic()
        got = tier.get(keys, bufs)
        elapsed = time.monotonic() - t0
        assert got == expected
        assert elapsed < timeout_s + 0.75, elapsed  # generous slack on a loaded CI machine
        assert tier.stats()["timeouts"] >= 1
        for k, b, ok in zip(keys, bufs, got, strict=True):
            if ok:
                np.testing.assert_array_equal(b, block(k))
        # during the cool-down the slow node's keys miss at once, the others still hit
        assert tier.contains(keys) == expected
        assert tier.stats()["node_skips"] >= 1
    finally:
        sleeper.join()
    # awake again and past the cool-down: everything hits again
    time.sleep(0.6)
    bufs = outs(30)
    assert tier.get(keys, bufs) == [True] * 30
    assert tier.stats()["corrupted_blocks"] == 0
    tier.close()


def test_a_corrupt_block_is_deleted_in_the_key_space_it_was_read_from(
    redis_url: str, redis_cluster: LocalRedisCluster
) -> None:
    """get() reads a corrupt block; a clear() and a put of the same key in the new key space
    happen before its clean-up DEL (injected between the two round trips). Before, the DEL
    went to the new key space: it deleted the fresh, valid block and left the corrupt one."""
    k = key(7)
    with RedisClusterTier(redis_url, FMT) as tier:
        assert tier.put([k], [block(k)]) == [True]
        old_rkey = tier._rkey(k)
        node = redis_cluster.client(redis_cluster.index_of(tier.node_of(k) or ""))
        value = bytearray(node.get(old_rkey))
        value[-1] ^= 0xFF  # a payload byte: the checksum fails
        node.set(old_rkey, bytes(value))
        real_run = tier._run

        def run(op: str, keys: list[bytes], *a: object, **kw: object) -> list[object]:
            out = real_run(op, keys, *a, **kw)  # type: ignore[arg-type]
            if op == "get":  # another thread: a cache reset, then a write-through
                tier.clear()
                assert tier.put([k], [block(k)]) == [True]
            return out

        tier._run = run  # type: ignore[method-assign]
        assert tier.get([k], outs(1)) == [False]
        tier._run = real_run  # type: ignore[method-assign]
        assert node.exists(old_rkey) == 0  # the corrupt block is gone
        bufs = outs(1)
        assert tier.get([k], bufs) == [True]  # the fresh block is still there and served
        np.testing.assert_array_equal(bufs[0], block(k))
        assert tier.stats()["corrupted_blocks"] == 1


def test_close_waits_for_a_slot_map_reload_in_flight(redis_url: str) -> None:
    """A node failure starts a slot-map reload on a thread of its own. Before, close() did
    not wait for it: the reload ran on the closed client after close() returned."""
    with RedisClusterTier(redis_url, FMT) as tier:
        assert tier.put([key(1)], [block(key(1))]) == [True]
        assert tier._rc is not None
        nm = tier._rc.nodes_manager
        real = nm.initialize
        started, finished = threading.Event(), threading.Event()

        def slow_initialize(*a: object, **kw: object) -> object:
            started.set()
            time.sleep(0.5)  # injected: a slow CLUSTER SLOTS (bounded by timeout_s per node)
            try:
                return real(*a, **kw)
            finally:
                finished.set()

        nm.initialize = slow_initialize  # type: ignore[method-assign]
        tier._node_failed(tier.node_of(key(1)) or "")  # what a timed-out round trip does
        assert started.wait(10)
        tier.close()
        assert finished.is_set()  # close() returned only after the reload ended
        assert tier.contains([key(1)]) == [False]  # closed: a miss


def test_a_node_failing_mid_round_trip_keeps_the_replies_already_read(
    redis_url: str, redis_cluster: LocalRedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The third reply of a round trip of four keys to one node times out (injected). Before,
    all four keys failed: put answered False (and counted writes_dropped) for the two blocks
    whose SET was acknowledged, and get missed two blocks it had verified and copied."""
    import redis

    from kvoff.tiers.redis_cluster import _SendFromBuffer

    with RedisClusterTier(redis_url, FMT, cooldown_s=0) as tier:
        node = tier.node_of(key(0))
        keys = [k for k in (key(i) for i in range(200)) if tier.node_of(k) == node][:4]
        assert len(keys) == 4
        assert tier.contains(keys) == [False] * 4  # connections made, nothing stored
        real = _SendFromBuffer.read_response
        me = threading.current_thread()  # one node: its round trip runs on this thread
        calls = [0]

        def flaky(self: _SendFromBuffer, *a: object, **kw: object) -> object:
            if threading.current_thread() is me:
                calls[0] += 1
                if calls[0] == 3:
                    raise redis.TimeoutError("injected timeout")
            return real(self, *a, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(_SendFromBuffer, "read_response", flaky)
        assert tier.put(keys, [block(k) for k in keys]) == [True, True, False, False]
        s = tier.stats()
        assert (s["blocks_written"], s["writes_dropped"], s["timeouts"]) == (2, 2, 1)
        monkeypatch.setattr(_SendFromBuffer, "read_response", real)
        admin = redis_cluster.client(redis_cluster.index_of(node or ""))
        assert [admin.exists(tier._rkey(k)) for k in keys[:2]] == [1, 1]  # really stored
        assert tier.put(keys[2:], [block(k) for k in keys[2:]]) == [True, True]

        calls[0] = 0
        monkeypatch.setattr(_SendFromBuffer, "read_response", flaky)
        bufs = outs(4)
        assert tier.get(keys, bufs) == [True, True, False, False]
        monkeypatch.setattr(_SendFromBuffer, "read_response", real)
        for k, b in zip(keys[:2], bufs[:2], strict=True):
            np.testing.assert_array_equal(b, block(k))
        s = tier.stats()
        assert (s["hits"], s["misses"], s["blocks_read"], s["timeouts"]) == (2, 2, 2, 2)
        assert s["corrupted_blocks"] == 0
        bufs = outs(4)
        assert tier.get(keys, bufs) == [True] * 4  # the connection left no reply behind
        for k, b in zip(keys, bufs, strict=True):
            np.testing.assert_array_equal(b, block(k))
