"""The node pool: one index for every engine, isolation by layout, ownership of every call,
lifetimes (engines killed at any point, the pool killed and restarted), hostile clients."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from node_pool_harness import Served, send_raw, start_pool_process

from kvoff.node_pool import NodePoolClient, NodePoolError, NodePoolServer
from kvoff.node_pool import protocol as p
from kvoff.pinned import HostPool, SharedMemoryError

FP = b"model=tiny;layout=layer_major;rank=0"


def _keys(*ids: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in ids]


def _counts(served) -> tuple[int, int, int, int]:
    """(stored, free, pending, evictable) of the index, read in the serving thread."""
    m = served.server.manager
    return served.call(
        lambda s: (
            m.num_stored_blocks,
            m.num_free_blocks,
            m.num_pending_blocks,
            m.num_evictable_blocks,
        )
    )


def test_a_block_stored_by_one_engine_is_a_hit_for_every_engine_of_its_layout(served) -> None:
    a = NodePoolClient(served.socket, FP, name="a")
    b = NodePoolClient(served.socket, FP, name="b")
    other = NodePoolClient(served.socket, FP + b";dtype=fp8", name="other")
    assert (a.region, a.num_slots, a.slot_bytes) == (served.region, 16, 4096)
    keys = _keys(1, 2, 3)
    out = a.prepare_store(keys)
    assert out is not None and out.keys_to_store == keys and len(set(out.block_ids)) == 3
    assert b.lookup(keys) is None  # being stored: retry later
    a.complete_store(keys)
    a.sync()  # the completion went without a reply: once a's sync returns, it is done
    assert b.lookup(keys) == 3 and a.lookup(keys[:2]) == 2
    assert other.lookup(keys) == 0  # another layout never shares a block
    assert b.prepare_load(keys) == out.block_ids  # leased by the look-up: sent, no reply
    b.complete_load(keys)
    b.sync()  # b's calls are done before a asks
    st_ = a.status()
    by_name = {e["name"]: e for e in st_["engines"]}
    assert st_["stored_blocks"] == 3 and st_["engines_attached"] == 3
    assert by_name["b"]["hit_blocks"] == 3 and by_name["b"]["loaded_blocks"] == 3
    assert by_name["a"]["stored_blocks"] == 3 and by_name["other"]["hit_blocks"] == 0


def test_slots_are_shared_memory_that_every_engine_maps(served) -> None:
    a = NodePoolClient(served.socket, FP)
    pool_a = HostPool([(16, 4096)], pin=False, shared_name=a.region, attach=True)
    pool_b = HostPool([(16, 4096)], pin=False, shared_name=a.region, attach=True)
    pool_a.tensors[0][5].fill_(7)
    assert torch.equal(pool_b.tensors[0][5], torch.full((4096,), 7, dtype=torch.uint8))
    pool_a.close()
    assert Path("/dev/shm", a.region).exists()  # an attached pool never removes the region
    with pytest.raises(SharedMemoryError, match=r"holds tensors \[\[0, 16, 4096\]\].*another"):
        HostPool([(16, 8192)], pin=False, shared_name=a.region, attach=True)


def test_an_engine_completes_only_its_own_loads_and_stores(served, caplog) -> None:
    a = NodePoolClient(served.socket, FP, name="a")
    b = NodePoolClient(served.socket, FP, name="b")
    keys = _keys(1, 2)
    a.prepare_store(keys)
    before = _counts(served)
    # b sends a completion of a's store, bypassing its client's bookkeeping: refused (sent
    # without a reply, the refusal comes back ahead of b's next reply, counted and logged)
    assert b._stores.begin(keys, [14, 15])  # slots b was never given
    with caplog.at_level(logging.ERROR, "kvoff.node_pool.client"):
        b.complete_store(keys)
        b.sync()
    assert b.async_errors == 1 and "not being stored by this engine" in caplog.text
    assert _counts(served) == before and b.lookup(keys) is None and b.attached
    a.complete_store(keys)
    a.prepare_load(keys)
    b._loads.pin(keys, [0, 1], True)  # as if b had pinned them: the pool says it did not
    b.complete_load(keys)
    b.sync()
    assert b.async_errors == 2 and "not being loaded by this engine" in caplog.text
    assert _counts(served) == (2, 14, 0, 0)  # still pinned by a
    a.complete_load(keys)
    a.sync()
    assert _counts(served) == (2, 14, 0, 2)


_ENGINE = textwrap.dedent(
    """
    import sys, time
    from kvoff.node_pool import NodePoolClient
    c = NodePoolClient(sys.argv[1], b"model=tiny;layout=layer_major;rank=0", name="victim")
    ready = [bytes([200]) * 16]
    out = c.prepare_store(ready)
    c.complete_store(out.keys_to_store)
    c.prepare_load(ready)                    # a load in flight
    c.prepare_store([bytes([201]) * 16, bytes([202]) * 16])   # a store in flight
    print("ready", flush=True)
    time.sleep(60)
    """
)


def test_an_engine_killed_mid_store_and_mid_load_leaks_nothing(served) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _ENGINE, served.socket],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    assert _counts(served) == (1, 13, 2, 0)  # 1 pinned, 2 being stored
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while _counts(served) != (1, 15, 0, 1) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _counts(served) == (1, 15, 0, 1)  # unpinned; the stores never became blocks
    c = NodePoolClient(served.socket, FP)
    assert c.lookup(_keys(200)) == 1 and c.lookup([bytes([201]) * 16]) == 0


_RANDOM_ENGINES = textwrap.dedent(
    """
    # imports kvoff once, then forks one engine per line read ("<seed>"), printing its pid:
    # an engine a test can kill every 0.1 s without paying for torch's import each time
    import os, random, signal, sys
    from kvoff.node_pool import NodePoolClient, NodePoolError
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the killed engines

    def engine(seed):
        # seeds >= 100 are victims: they load the others' blocks (keys 0-39) but never finish
        # a store of their own (keys 40-79), so none of those may ever be a hit
        c = NodePoolClient(sys.argv[1], b"model=tiny;layout=layer_major;rank=0", name="random",
                           reserve=True)  # stores into reserved slots too
        rnd = random.Random(seed)
        victim = seed >= 100
        print(os.getpid(), flush=True)
        while True:
            keys = [bytes([rnd.randrange(40)]) * 16 for _ in range(rnd.randrange(1, 5))]
            keys = list(dict.fromkeys(keys))
            if victim:
                n = c.lookup(keys)
                if n:
                    try:
                        c.prepare_load(keys[:n])  # pinned until the kill, or released
                    except NodePoolError:
                        continue
                    if rnd.random() < 0.5:
                        c.complete_load(keys[:n])
                mine = [bytes([40 + k[0]]) * 16 for k in keys]
                out = c.prepare_store(mine)
                if out is not None and rnd.random() < 0.3:
                    c.complete_store(out.keys_to_store, False)
                continue
            n = c.lookup(keys)
            if n:
                try:
                    c.prepare_load(keys[:n])
                except NodePoolError:  # evicted by another engine since the lookup
                    n = 0
                if n and rnd.random() < 0.9:
                    c.complete_load(keys[:n])
            out = c.prepare_store(keys)
            if out is not None and rnd.random() < 0.9:
                c.complete_store(out.keys_to_store, rnd.random() < 0.9)

    for line in sys.stdin:
        if os.fork() == 0:
            engine(int(line))
    """
)


def test_engines_killed_at_random_points_leak_no_slot_and_no_pin(served) -> None:
    """Two engines hammer the pool while a third is SIGKILLed at a random moment, 100 times
    over (issue 56's target; docs/design.md invariant 10). After each kill the pool's counts
    add up (no slot leaked, nothing pending or pinned is left of the dead, the living engines
    go on), and no block the dead were storing is ever a hit."""
    rng = __import__("random").Random(7)
    spawner = subprocess.Popen(
        [sys.executable, "-c", _RANDOM_ENGINES, served.socket],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert spawner.stdin is not None and spawner.stdout is not None

    def fork(seed: int) -> int:
        spawner.stdin.write(f"{seed}\n")
        spawner.stdin.flush()
        return int(spawner.stdout.readline())

    def held(s: NodePoolServer) -> tuple[int, int, int, int, int, int]:
        m = s.manager
        pins = sum(sum(e.pins.values()) + len(e.leases) for e in s.engines.values())
        storing = sum(len(e.storing) for e in s.engines.values())
        # the key filter (invariant 9): every key in the index is "maybe", whoever died
        assert s.key_filter is not None and s.key_filter.unknown_removals == 0
        assert all(s.key_filter.filter.may_contain(k) for k in every_key if m.lookup([k]) != 0)
        reserved = sum(len(e.reserved) + len(e.duplicates) for e in s.engines.values())
        assert m.num_reserved_blocks == reserved  # only the living engines hold reservations
        return (m.num_pending_blocks, storing, m.num_stored_blocks, m.num_free_blocks + reserved,
                m.num_evictable_blocks, pins)  # fmt: skip

    prefix = hashlib.blake2b(FP, digest_size=8).digest()  # the engines' key prefix
    every_key = [prefix + bytes([k]) * 16 for k in range(80)]

    survivors = [fork(1), fork(2)]
    try:
        checker = NodePoolClient(served.socket, FP, name="checker")
        theirs = [bytes([k]) * 16 for k in range(40, 80)]
        for trial in range(100):
            victim = fork(100 + trial)
            time.sleep(rng.uniform(0.0, 0.1))
            os.kill(victim, signal.SIGKILL)
            for pid in survivors:
                os.kill(pid, signal.SIGSTOP)  # a moment with only the dead's state to clear
            deadline = time.monotonic() + 5
            while served.call(lambda s: len(s.engines)) > 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            pending, storing, stored, free, evictable, pins = served.call(held)
            assert pending == storing  # only the living engines' stores are in flight
            assert stored + free + pending == 16  # no slot leaked (free: or reserved)
            assert stored - evictable <= pins  # only the living engines pin (or lease) blocks
            assert all(checker.lookup([k]) == 0 for k in theirs)  # never served
            for pid in survivors:
                os.kill(pid, signal.SIGCONT)
        assert served.call(lambda s: s.engines_seen) == 103  # and 3 live: survivors, checker
        assert served.call(lambda s: s.reserved_stores) > 0  # stores into reserved slots too
        assert served.call(lambda s: len(s.engines)) == 3
    finally:
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        spawner.kill()
        spawner.wait()


def test_a_pool_killed_and_restarted_under_an_engine_means_misses_then_hits(
    tmp_path: Path,
) -> None:
    sock = str(tmp_path / "pool.sock")
    region = f"kvoff-test-np-restart-{os.getpid()}"

    def start() -> subprocess.Popen[bytes]:
        return start_pool_process(sock, region, 16)

    server = start()
    try:
        c = NodePoolClient(sock, FP, retry_s=0.05)
        out = c.prepare_store(_keys(1))
        c.complete_store(out.keys_to_store)
        c.prepare_store(_keys(2))  # in flight when the pool dies
        assert c.lookup(_keys(1)) == 1
        server.send_signal(signal.SIGKILL)
        server.wait()
        # gone: misses, nothing stored, no error reaches the caller
        assert c.lookup(_keys(1)) == 0 and c.prepare_store(_keys(3)) is None
        c.complete_store(_keys(2))  # dropped: the old pool's store
        assert c.misses_while_detached >= 2 and not c.attached
        server = start()  # adopts the region: the engine's mapping is still the pool's memory
        time.sleep(0.1)  # past retry_s
        assert c.lookup(_keys(1)) == 0 and c.attached  # back, and the index starts empty
        out = c.prepare_store(_keys(1))
        assert out is not None
        c.complete_store(out.keys_to_store)
        assert c.lookup(_keys(1)) == 1 and c.attached
        assert c.status()["engines_attached"] == 1
    finally:
        server.terminate()
        server.wait()
    assert not os.path.exists(sock) and not Path("/dev/shm", region).exists()  # clean stop


def test_a_pool_that_adopts_a_region_listens_only_after_the_grace(tmp_path: Path) -> None:
    """A pool that adopts a region (an engine still maps it) hands out no slot for
    ADOPT_GRACE_S: an engine may still copy to or from the slots for the pool before (a load of
    a lease after the pool died, a store in flight). A pool that makes its region listens at
    once."""
    from kvoff.node_pool.server import ADOPT_GRACE_S

    region = f"kvoff-test-np-grace-{os.getpid()}"
    sock = tmp_path / "pool.sock"
    first = Served(sock, region)
    mapping = HostPool([(16, 4096)], pin=False, shared_name=region, attach=True)
    try:
        assert not first.server.adopted
        first.stop()  # a clean stop: the engine's mapping keeps the region
        before = time.monotonic()
        second = Served(sock, region)
        try:
            srv = second.server
            assert srv.adopted and before <= srv.adopted_at
            assert srv.listening_since - srv.adopted_at >= ADOPT_GRACE_S
            assert NodePoolClient(str(sock), FP).lookup(_keys(1)) == 0  # then it serves
        finally:
            second.stop()
    finally:
        first.stop()
        mapping.close()
        for leftover in (Path("/dev/shm", region), Path("/dev/shm", f"{region}.keys")):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


def test_a_pool_stopped_cleanly_under_an_engine_is_adopted_by_the_next_one(
    tmp_path: Path,
) -> None:
    """A clean stop (SIGTERM: systemctl restart, an upgrade) keeps the region while an engine
    maps it (docs/design.md invariant 11), so the next pool adopts it and the engine hits again
    without a restart; the last mapping to go removes the region."""
    sock = str(tmp_path / "pool.sock")
    region = f"kvoff-test-np-stop-{os.getpid()}"
    path = Path("/dev/shm", region)
    server = start_pool_process(sock, region, 16)
    mapping = None
    try:
        c = NodePoolClient(sock, FP, retry_s=0.05)
        mapping = HostPool([(16, 4096)], pin=False, shared_name=region, attach=True)
        out = c.prepare_store(_keys(1))
        mapping.tensors[0][out.block_ids[0]].fill_(7)  # the engine's copy into the slot
        c.complete_store(out.keys_to_store)
        server.terminate()
        assert server.wait(10) == 0
        assert path.exists() and not os.path.exists(sock)  # kept: the engine maps it
        # gone: misses, nothing stored, no error reaches the caller
        assert c.lookup(_keys(1)) == 0 and c.prepare_store(_keys(3)) is None
        assert not c.attached
        server = start_pool_process(sock, region, 16)  # adopts it (index empty)
        time.sleep(0.1)  # past retry_s
        assert c.lookup(_keys(1)) == 0 and c.attached  # the same region: attached again
        out = c.prepare_store(_keys(1))
        mapping.tensors[0][out.block_ids[0]].fill_(9)
        c.complete_store(out.keys_to_store)
        c.flush()
        other = NodePoolClient(sock, FP)
        assert other.lookup(_keys(1)) == 1  # a hit again, for every engine
        slot = other.prepare_load(_keys(1))[0]
        other.complete_load(_keys(1))
        seen = HostPool([(16, 4096)], pin=False, shared_name=region, attach=True)
        assert int(seen.tensors[0][slot].sum()) == 9 * 4096  # the engine's bytes
        seen.close()
        server.terminate()
        assert server.wait(10) == 0
        assert path.exists()  # the engine still maps it
        mapping.close()  # the last mapping: the region goes
        mapping = None
        assert not path.exists()
    finally:
        server.kill()
        server.wait()
        if mapping is not None:
            mapping.close()
        for leftover in (path, Path(f"{path}.keys")):  # (after a failure: a killed pool's)
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


def test_a_second_pool_on_a_served_socket_is_refused_and_leaves_nothing(served) -> None:
    region = f"{served.region}-second"
    with pytest.raises(ValueError, match="already serves"):
        NodePoolServer(served.socket, 16, 4096, region=region)
    assert not Path("/dev/shm", region).exists()  # its region and key filter are gone
    assert not Path("/dev/shm", region + ".keys").exists()
    assert NodePoolClient(served.socket, FP).lookup(_keys(1)) == 0  # the first serves on


def test_socket_is_private_to_the_user(served) -> None:
    assert stat.S_IMODE(os.stat(served.socket).st_mode) == 0o600


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_another_user_is_refused() -> None:
    from node_pool_harness import Served

    folder = tempfile.mkdtemp(prefix="kvoff-np-uid-")
    os.chmod(folder, 0o755)  # the other user can reach the socket: its uid must decide
    served = Served(Path(folder, "pool.sock"), f"kvoff-test-np-uid-{os.getpid()}")
    try:
        _refused(served)
    finally:
        served.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _refused(served) -> None:
    os.chmod(served.socket, 0o777)  # even through the file mode, the peer's uid decides
    code = textwrap.dedent(
        f"""
        import os, socket, sys
        os.setgid(65534); os.setuid(65534)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect({served.socket!r})
        s.settimeout(5)
        try:
            s.sendall({p.frame(p.LOOKUP, 1, p.encode_keys([b"x" * 16]))!r})
            sys.exit(0 if s.recv(100) == b"" else 3)  # closed without a reply
        except (ConnectionResetError, BrokenPipeError):
            sys.exit(0)
        """
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
    assert served.call(lambda s: s.refused) == 1


def test_a_pool_that_grants_slots_it_does_not_have_is_left_and_its_grants_unused(
    served, caplog
) -> None:
    """The engine's table of its stores in flight is indexed by slot: a grant past the pool's
    slot count (its hello) is a broken pool. The engine leaves it as if it were gone (misses,
    no error), begins no store, and the pool releases what it granted."""
    a = NodePoolClient(served.socket, FP, name="a")
    a._stores.set_num_slots(2)  # the pool's grants of slots 2.. are now past its count
    keys = _keys(1, 2, 3, 4)
    assert a.prepare_store(keys) is None  # no exception reaches the engine
    assert not a.attached and a.num_storing == 0
    deadline = time.monotonic() + 10
    while _counts(served)[2] and time.monotonic() < deadline:
        time.sleep(0.01)  # the pool drops the connection's grants when it sees it close
    assert _counts(served)[2] == 0  # no slot left pending
    b = NodePoolClient(served.socket, FP, name="b")
    out = b.prepare_store(keys)
    assert out is not None and out.keys_to_store == keys

    # a reservation (granted ahead, read without a call waiting for it) past the count
    c = NodePoolClient(served.socket, FP, name="c", reserve=True)
    c._stores.set_num_slots(1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvoff.node_pool"):
        c.prepare_store(_keys(9))
        c.take_events()
        c.sync()
    assert "reservation: the node pool gave slot" in caplog.text
    # nothing of the grant was taken (a later call attaches again, and is refused again)
    assert c.num_storing == 0 and c._stores.num_reserved == 0
    assert c.stores_on_reservation == 0
    assert b.lookup(keys) is None  # the pool still serves: b's stores are pending


@pytest.mark.parametrize("leased", [True, False], ids=["leased", "asked"])
def test_a_pool_that_gives_a_load_slots_it_does_not_have_is_left_and_its_pins_released(
    served, leased
) -> None:
    """The engine's table of its loads in flight is indexed by slot too: a load's slot past
    the pool's slot count (a leased one, or one in the prepare_load reply) is a broken pool.
    The load fails (NodePoolError, the caller's failed load), nothing is recorded, the engine
    leaves the pool, and the pool releases the pins and leases of that connection."""
    a = NodePoolClient(served.socket, FP, name="a")
    keys = _keys(1, 2)
    out = a.prepare_store(keys)
    a.complete_store(out.keys_to_store)
    a.sync()  # the completion is queued until then
    b = NodePoolClient(served.socket, FP, name="b", lookahead=0 if not leased else 256)
    b._loads.set_num_slots(0)  # every slot the pool gives is now past its count
    if leased:
        assert b.lookup(keys) == 2  # leased: prepare_load sends without a reply
    with pytest.raises(NodePoolError, match="gave slot"):
        b.prepare_load(keys)
    assert not b.attached and b.num_loads == 0 and b.load_pins(keys[0]) == 0
    deadline = time.monotonic() + 10
    while _counts(served)[3] != 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # the pool releases the connection's pins when it sees it close
    assert _counts(served)[3] == 2  # both blocks evictable again: no pin or lease left
    c = NodePoolClient(served.socket, FP, name="c")
    assert c.lookup(keys) == 2
    slots = c.prepare_load(keys)
    assert c.num_loads == 2 and c.loading_slot(keys[1]) == slots[1]
    c.complete_load([bytearray(k) for k in keys])  # bytes-like keys, as before
    c.sync()
    assert c.num_loads == 0 and c.async_errors == 0 and _counts(served)[3] == 2


def _raw(served, data: bytes) -> bytes:
    return send_raw(served.socket, data)


def test_hostile_frames_get_errors_and_change_nothing(served) -> None:
    good = NodePoolClient(served.socket, FP)
    out = good.prepare_store(_keys(1))
    good.complete_store(out.keys_to_store)
    before = _counts(served)
    bad_version = p.HEADER.pack(b"KVNP", 99, p.LOOKUP, 1, 0)
    reply = _raw(served, bad_version)
    assert p.parse_header(reply[:16])[0] == p.ERROR and b"protocol version 99" in reply
    assert b"magic" in _raw(served, b"GET / HTTP/1.1\r\n\r\n")
    oversized = p.HEADER.pack(b"KVNP", p.VERSION, p.LOOKUP, 1, p.MAX_PAYLOAD_BYTES + 1)
    assert b"over the" in _raw(served, oversized)
    truncated_keys = p.frame(p.LOOKUP, 2, struct.pack("<I", 1000) + b"\x05\x00ab")
    assert b"key list" in _raw(served, truncated_keys)
    assert b"unknown op" in _raw(served, p.frame(77, 3, p.encode_keys([b"k"])))
    assert _raw(served, p.HEADER.pack(b"KVNP", p.VERSION, p.LOOKUP, 1, 50)[:10]) == b""
    assert _counts(served) == before and good.lookup(_keys(1)) == 1


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    op=st.sampled_from(sorted(p.OPS)) | st.integers(0, 0xFFFF),
    payload=st.binary(max_size=300),
    tail=st.binary(max_size=40),
)
def test_random_messages_never_crash_or_corrupt_the_pool(served, op, payload, tail) -> None:
    """Any op with any payload (and garbage after it): an error or an answer, never a crash;
    afterwards every slot is accounted for and a good engine is served."""
    _raw(served, p.frame(op, 9, payload) + tail)
    stored, free, pending, _ = _counts(served)
    # the dead connection's stores dropped, its reservation released
    assert stored + free + pending == 16 and pending == 0
    assert served.call(lambda s: s.manager.num_reserved_blocks) == 0
    assert served.thread.is_alive()
    good = NodePoolClient(served.socket, FP)
    assert good.lookup(_keys(99)) == 0
    good.close()
