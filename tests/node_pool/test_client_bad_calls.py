"""Bad arguments to an engine's node pool client (kvoff.node_pool.client, .keys): each is refused
with an error that names it, before anything is sent, and the client stays attached with the
pool unchanged. Before these checks a single key or None gave Python's own errors ("'int' object
is not iterable"), an int key became that many zero bytes (``bytes(5)``: another block's key),
an empty key was sent and the client then dropped its connection on the pool's answer, and a
touch with the wrong number of reused flags was only logged by the pool, after the fact; a
completion's ``success=None`` was read as False (the store dropped)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvoff.node_pool import NodePoolClient

FP = b"model=tiny;layout=layer_major;rank=0"
KEYS = [bytes([i]) * 16 for i in range(1, 4)]
SINGLE = r"keys must be a list or tuple of offload keys \(bytes\), got "
BOOL = r"success must be a bool \(True or False\), got "


def _pool_counts(c: NodePoolClient) -> tuple:
    c.sync()
    st = c.status()
    names = ("stored_blocks", "free_blocks", "pending_blocks", "pinned_blocks")
    return tuple(st[n] for n in names)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda c: c.lookup(KEYS[0]), TypeError, SINGLE + "bytes"),
        (lambda c: c.lookup(None), TypeError, SINGLE + "NoneType"),
        (lambda c: c.lookup([5]), TypeError, r"keys\[0\] must be bytes .*got int 5"),
        (lambda c: c.lookup([KEYS[0], None]), TypeError, r"keys\[1\] must be bytes .*got NoneType"),
        (lambda c: c.lookup_states(7), TypeError, SINGLE + "int"),
        (lambda c: c.lookup_states([[b"a"]]), TypeError, r"a key must be bytes .*got list"),
        (lambda c: c.prepare_load(KEYS[0]), TypeError, SINGLE + "bytes"),
        (lambda c: c.prepare_store([b"", KEYS[0]]), ValueError, r"keys\[0\] is 0 bytes; .*1016"),
        (lambda c: c.prepare_store([KEYS[0], b""]), ValueError, r"keys\[1\] is 0 bytes"),
        (lambda c: c.prepare_store([b"x" * 2000]), ValueError, r"keys\[0\] is 2000 bytes"),
        (lambda c: c.prepare_store([5, 6]), TypeError, r"keys\[0\] must be bytes .*got int 5"),
        (lambda c: c.ask_store(None), TypeError, SINGLE + "NoneType"),
        (lambda c: c.complete_store([7]), TypeError, r"keys\[0\] must be bytes .*got int 7"),
        (lambda c: c.complete_load([-1]), TypeError, r"keys\[0\] must be bytes .*got int -1"),
        (lambda c: c.key_states(3), TypeError, SINGLE + "int"),
        (lambda c: c.key_state(3), TypeError, r"key must be bytes \(an offload key\), got int 3"),
        (lambda c: c.load_pins("k"), TypeError, r"key must be bytes .*got str 'k'"),
        (lambda c: c.loading_slot(None), TypeError, r"key must be bytes .*got NoneType"),
        (lambda c: c.storing_slot(2**70), TypeError, r"key must be bytes .*got int"),
        (lambda c: c.touch(5), TypeError, SINGLE + "int"),
        (lambda c: c.touch(KEYS, [True]), ValueError, r"touch of 3 keys with 1 reused flags"),
        (lambda c: c.touch(KEYS, 1), TypeError, r"reused must be a sequence of bools, one per key"),
        (lambda c: c.complete_store(KEYS[1:2], None), TypeError, BOOL + "NoneType"),
        (lambda c: c.complete_store_slots([c.storing_slot(KEYS[1])], 0), TypeError, BOOL + "int"),
    ],
)  # fmt: skip
def test_bad_keys_are_named_nothing_is_sent_and_the_client_stays_attached(
    served, call: Callable, error: type, match: str
) -> None:
    c = NodePoolClient(served.socket, FP, name="engine")
    out = c.prepare_store(KEYS[:2])
    assert out is not None
    c.complete_store(KEYS[:1])
    before = _pool_counts(c)
    with pytest.raises(error, match=match):
        call(c)
    assert c.attached and _pool_counts(c) == before and c.async_errors == 0
    # the engine goes on
    c.complete_store(KEYS[1:2])
    assert c.lookup(KEYS) == 2
    c.close()
