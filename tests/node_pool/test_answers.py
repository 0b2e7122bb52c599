"""The client's memory of the pool between round trips (kvoff.node_pool.answers): the
look-ahead's answers expire and skip other engines' keys; leases are used only whole, fresh and
once, and a load after the pool's loss takes only leases held recently enough."""

from __future__ import annotations

import time

import pytest

from kvoff.node_pool import protocol as p
from kvoff.node_pool.answers import SWEEP_ABOVE, KeptAnswers, Leases

PRE = b"P" * 8
OTHER = b"O" * 8


def test_kept_answers_skip_other_engines_and_expire() -> None:
    kept = KeptAnswers(PRE, lookahead_s=0.05)
    kept.remember(
        [PRE + b"a", OTHER + b"b", PRE + b"c"], bytes([p.STATE_READY] * 2 + [p.STATE_PENDING])
    )
    assert kept.current() == {b"a": p.STATE_READY, b"c": p.STATE_PENDING}
    kept.clear()
    assert kept.current() == {}
    kept.remember([PRE + b"a"], bytes([p.STATE_READY]))
    time.sleep(0.06)
    assert kept.current() == {}, "answers older than lookahead_s are not used"


def test_a_lease_is_used_only_when_every_key_is_leased_fresh_and_once() -> None:
    leases = Leases(PRE)
    keys = [PRE + b"a", PRE + b"b", OTHER + b"c", PRE + b"d"]
    states = bytes([p.STATE_READY, p.STATE_READY, p.STATE_READY, p.STATE_MISSING])
    leases.add(keys, states, [5, 6, 7, -1], lease_s=0.5)
    assert len(leases) == 2  # another engine's key and a missing one hold no lease
    now = time.monotonic()
    assert leases.take_fresh([b"a", b"d"], now - 1) is None  # d is not leased
    assert leases.take_fresh([b"a", b"a"], now - 1) is None  # a key twice
    assert leases.take_fresh([b"a"], now + 1) is None  # not fresh enough
    assert leases.take_fresh([], now - 1) is None
    assert len(leases) == 2, "a refused take changes nothing"
    assert leases.take_fresh([b"b", b"a"], now - 1) == [6, 5]
    assert len(leases) == 0, "a lease is used once"


def test_a_load_after_loss_needs_every_key_leased_recently() -> None:
    leases = Leases(PRE)
    leases.add([PRE + b"a", PRE + b"b"], bytes([p.STATE_READY] * 2), [1, 2], lease_s=0.5)
    now = time.monotonic()
    snap = leases.snapshot([b"a", b"b"])
    assert Leases.held_after(snap, now - 1) == [1, 2]
    assert Leases.held_after(snap, now + 1) is None  # leased too long ago
    assert Leases.held_after(leases.snapshot([b"a", b"x"]), now - 1) is None  # x not leased
    assert leases.snapshot([b"a", b"a"]) == [None]
    assert Leases.held_after([], now - 1) is None
    leases.age_all(0.3)
    assert Leases.held_after(leases.snapshot([b"a"]), now - 0.2) is None
    leases.discard([b"a"])
    assert leases.snapshot([b"a", b"b"])[0] is None
    leases.clear()
    assert len(leases) == 0


@pytest.mark.parametrize("lapsed", [True, False])
def test_lapsed_leases_are_swept_once_there_are_many(lapsed: bool) -> None:
    leases = Leases(PRE)
    n = SWEEP_ABOVE
    old = [PRE + i.to_bytes(4, "little") for i in range(n)]
    leases.add(old, bytes([p.STATE_READY]) * n, list(range(n)), lease_s=0.5)
    if lapsed:
        leases.age_all(1.0)  # older than lease_s: lapsed at the pool
    leases.add([PRE + b"new"], bytes([p.STATE_READY]), [n], lease_s=0.5)
    assert len(leases) == (1 if lapsed else n + 1)
