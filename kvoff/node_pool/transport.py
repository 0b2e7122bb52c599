"""The byte stream under an engine's node-pool connection: :class:`PoolSocket`.

It connects to the pool's Unix socket, sends bytes and reads frames
(:mod:`kvoff.node_pool.protocol`), and waits for replies the way a pool that answers in tens
of microseconds needs: it spins on the non-blocking socket first, then sleeps in ``poll``. What
the frames mean (request ids, the outbox, the frames nobody waits for, losing the pool) is
:class:`kvoff.node_pool.NodePoolClient`'s.
"""

from __future__ import annotations

import select
import socket
import time

from kvoff.node_pool import protocol as p

__all__ = ["PoolSocket"]

_CHUNK_BYTES = 65536
"""Bytes asked of the socket per read: a whole reply in one read usually (a step's look-up
reply is a few KiB)."""


class PoolSocket:
    """A non-blocking connection to the node pool at ``path``.

    Args:
        path: the pool's socket file.
        timeout_s: seconds to connect, to wait for a reply, or to wait while the pool reads
            nothing, before a call fails.
        spin_s: seconds a read spins on the socket before it sleeps in ``poll`` (the pool
            answers in tens of microseconds; a sleeping thread takes as long to wake).

    Raises:
        OSError: nothing accepts at ``path`` (the socket is closed again).
    """

    def __init__(self, path: str, timeout_s: float, spin_s: float) -> None:
        self.timeout_s, self.spin_s = timeout_s, spin_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            sock.setblocking(False)  # from here on, replies are spun for, then polled for
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._rest = bytearray()  # bytes read past the last frame taken

    @property
    def buffered(self) -> bool:
        """Whether bytes read from the socket wait to be taken as frames."""
        return bool(self._rest)

    def close(self) -> None:
        """Closes the socket (the pool then releases what this connection held). Idempotent."""
        self._sock.close()
        self._rest = bytearray()

    def sendall(self, data: bytes) -> None:
        """Sends all of ``data``, waiting while the socket's buffer is full.

        Raises:
            TimeoutError: the pool read nothing for ``timeout_s``.
            OSError: the connection is gone.
        """
        sock = self._sock
        view = memoryview(data)
        while view:
            try:
                view = view[sock.send(view) :]
            except BlockingIOError:
                poll = select.poll()
                poll.register(sock, select.POLLOUT)
                if not poll.poll(self.timeout_s * 1000):
                    raise TimeoutError(
                        f"the node pool read nothing for {self.timeout_s:g} s"
                    ) from None

    def recv_frame(self) -> tuple[int, int, bytes]:
        """The next frame, waiting for it: (op, request id, payload).

        Raises:
            TimeoutError: nothing came within ``timeout_s``.
            ConnectionError: the pool closed the connection.
            kvoff.node_pool.protocol.ProtocolError: a header that does not parse.
        """
        rop, rid, length = p.parse_header(self._recv(p.HEADER.size))
        return rop, rid, self._recv(length)

    def read_ready(self) -> None:
        """Reads what the socket has now into the buffer, without waiting.

        Raises:
            ConnectionError: the pool closed the connection.
            OSError: the connection failed.
        """
        # one recv, usually: a chunk short of the buffer is all there was, and a second recv
        # only to hear EAGAIN costs as much again (a refill's reply is read about every third
        # store)
        try:
            while len(chunk := self._sock.recv(_CHUNK_BYTES)) == _CHUNK_BYTES:
                self._rest += chunk
        except BlockingIOError:
            return
        if not chunk:
            raise ConnectionError("the node pool closed the connection")
        self._rest += chunk

    def take_frame(self) -> tuple[int, int, bytes] | None:
        """A whole frame from the buffer, without reading the socket: (op, request id,
        payload), or None when the buffer holds no whole frame.

        Raises:
            kvoff.node_pool.protocol.ProtocolError: a header that does not parse.
        """
        buf, size = self._rest, p.HEADER.size
        if len(buf) < size:
            return None
        rop, rid, length = p.parse_header(bytes(buf[:size]))
        if len(buf) < size + length:
            return None
        body = bytes(buf[size : size + length])
        del buf[: size + length]
        return rop, rid, body

    def _recv(self, n: int) -> bytes:
        # one recv usually brings a whole reply: what is past n waits in self._rest
        buf = self._rest
        while len(buf) < n:
            chunk = self._recv_some(max(_CHUNK_BYTES, n - len(buf)))
            if not chunk:
                raise ConnectionError("the node pool closed the connection")
            buf += chunk
        self._rest = buf[n:]
        return bytes(buf[:n])

    def _recv_some(self, size: int) -> bytes:
        """What the socket has, waiting for it: spinning for ``spin_s``, then polling for up
        to ``timeout_s``.

        Raises:
            TimeoutError: nothing came within ``timeout_s``.
        """
        sock = self._sock
        clock = time.perf_counter
        spin_until = clock() + self.spin_s
        while True:
            try:
                return sock.recv(size)
            except BlockingIOError:
                if clock() < spin_until:
                    continue
            if not self._poll.poll(self.timeout_s * 1000):
                raise TimeoutError(f"the node pool did not answer within {self.timeout_s:g} s")
