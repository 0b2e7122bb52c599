"""PoolSocket, the byte stream under an engine's node-pool connection, against a real Unix
socket whose other end the test drives byte by byte."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoff.node_pool import protocol as p
from kvoff.node_pool.transport import PoolSocket


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[PoolSocket, socket.socket]]:
    """A PoolSocket connected to a listener of the test's, and the accepted other end."""
    path = str(tmp_path / "pool.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    ps = PoolSocket(path, timeout_s=0.5, spin_s=0.0001)
    peer, _ = listener.accept()
    listener.close()
    yield ps, peer
    ps.close()
    peer.close()


def _wait_readable(ps: PoolSocket, want: int) -> None:
    """Reads until ``want`` frames are buffered whole (the peer's bytes take a moment)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        ps.read_ready()
        if ps.buffered and len(ps._rest) >= want:
            return
        time.sleep(0.001)
    raise AssertionError("the peer's bytes never arrived")


def test_a_frame_sent_in_pieces_is_read_whole_and_the_next_one_waits_in_the_buffer(pair):
    ps, peer = pair
    first = p.frame(p.LOOKUP_AHEAD | p.REPLY, 7, b"x" * 100_000)  # past one read's chunk
    second = p.frame(p.STATUS | p.REPLY, 8, b"done")
    data = first + second
    for i in range(0, len(data), 4093):  # pieces that split the headers too
        peer.sendall(data[i : i + 4093])
    assert ps.recv_frame() == (p.LOOKUP_AHEAD | p.REPLY, 7, b"x" * 100_000)
    assert ps.recv_frame() == (p.STATUS | p.REPLY, 8, b"done")
    assert not ps.buffered


def test_take_frame_hands_out_only_whole_frames(pair):
    ps, peer = pair
    whole = p.frame(p.RESERVE | p.REPLY, 3, b"\x01abc")
    peer.sendall(whole + whole[:10])  # a second frame cut inside its header
    _wait_readable(ps, len(whole) + 10)
    assert ps.take_frame() == (p.RESERVE | p.REPLY, 3, b"\x01abc")
    assert ps.take_frame() is None and ps.buffered  # the cut frame stays for later
    peer.sendall(whole[10:-1])  # all but its last payload byte
    _wait_readable(ps, len(whole) - 1)
    assert ps.take_frame() is None
    peer.sendall(whole[-1:])
    _wait_readable(ps, len(whole))
    assert ps.take_frame() == (p.RESERVE | p.REPLY, 3, b"\x01abc")
    assert ps.take_frame() is None and not ps.buffered


def test_read_ready_never_waits_and_a_closed_pool_is_a_connection_error(pair):
    ps, peer = pair
    t0 = time.perf_counter()
    ps.read_ready()  # nothing there: returns at once
    assert time.perf_counter() - t0 < 0.25 and not ps.buffered
    peer.close()
    with pytest.raises(ConnectionError, match="closed the connection"):
        for _ in range(1000):  # the close reaches this end at once on a Unix socket
            ps.read_ready()
    with pytest.raises(ConnectionError, match="closed the connection"):
        ps.recv_frame()


def test_a_pool_that_does_not_answer_times_out_after_timeout_s(pair):
    ps, peer = pair
    peer.sendall(p.frame(p.STATUS | p.REPLY, 1, b"abcdef")[:20])  # a header and a partial body
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"did not answer within 0\.5 s"):
        ps.recv_frame()
    assert 0.4 < time.perf_counter() - t0 < 5


def test_a_header_that_does_not_parse_is_a_protocol_error(pair):
    ps, peer = pair
    peer.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
    with pytest.raises(p.ProtocolError):
        ps.recv_frame()


def test_sendall_delivers_more_than_the_socket_buffer_holds(pair):
    ps, peer = pair
    data = bytes(range(256)) * 40_000  # 10 MB: the send waits for the peer to read
    got = bytearray()
    peer.setblocking(False)

    def drain() -> None:
        while True:
            try:
                chunk = peer.recv(1 << 20)
            except BlockingIOError:
                return
            got.extend(chunk)

    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            drain()
            time.sleep(0.0005)
        drain()

    t = threading.Thread(target=reader)
    t.start()
    try:
        ps.sendall(data)
    finally:
        stop.set()
        t.join()
    assert bytes(got) == data


def test_sendall_to_a_pool_that_reads_nothing_times_out(pair):
    ps, _peer = pair
    with pytest.raises(TimeoutError, match=r"read nothing for 0\.5 s"):
        ps.sendall(b"\0" * (64 << 20))  # far past what the kernel buffers


def test_connecting_to_nothing_is_an_os_error(tmp_path: Path):
    with pytest.raises(OSError):
        PoolSocket(str(tmp_path / "nobody.sock"), timeout_s=0.5, spin_s=0.0)
