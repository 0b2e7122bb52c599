"""The ``unique`` bundled trace and the reuse windows of :mod:`kvoff.tools.trace_windows`."""

from __future__ import annotations

import time

import pytest

from kvoff.tools.replay import ReplayConfig, run_replay
from kvoff.tools.trace_windows import ReuseWindow, best_reuse_window, reuse_windows
from kvoff.tools.traces import (
    BUNDLED_TRACES,
    UNIQUE_HASH_ID_BASE,
    TraceRequest,
    load_trace,
    resolve_trace,
    unique_hash_ids,
)


@pytest.fixture(scope="module")
def conversation() -> list[TraceRequest]:
    return load_trace("conversation")


@pytest.fixture(scope="module")
def unique() -> list[TraceRequest]:
    return load_trace("unique")


# ------------------------------------------------------------------------------ unique trace


def test_unique_is_bundled_and_resolves_to_the_conversation_file() -> None:
    assert "unique" in BUNDLED_TRACES
    assert resolve_trace("unique") == resolve_trace("conversation")
    assert resolve_trace("unique").is_file()


def test_unique_keeps_the_conversation_requests(
    conversation: list[TraceRequest], unique: list[TraceRequest]
) -> None:
    assert len(unique) == len(conversation) == 12031
    for u, c in zip(unique, conversation, strict=True):
        assert (u.timestamp_ms, u.input_length, u.output_length) == (
            c.timestamp_ms,
            c.input_length,
            c.output_length,
        )
        assert len(u.hash_ids) == len(c.hash_ids)


def test_unique_shares_no_hash_id(
    conversation: list[TraceRequest], unique: list[TraceRequest]
) -> None:
    ids = [h for r in unique for h in r.hash_ids]
    assert len(ids) == len(set(ids)) == sum(len(r.hash_ids) for r in conversation) == 288500
    assert ids == list(range(UNIQUE_HASH_ID_BASE, UNIQUE_HASH_ID_BASE + len(ids)))
    assert not set(ids) & {h for r in conversation for h in r.hash_ids}
    # deterministic, and a limit gives the same first requests
    assert load_trace("unique", limit=25) == unique[:25]


def test_unique_trace_has_no_reuse(unique: list[TraceRequest]) -> None:
    assert all(w.reuse_tokens == 0 for w in reuse_windows(unique, 500, 500))


def test_unique_replay_hits_nothing() -> None:
    res = run_replay(ReplayConfig(trace="unique", limit=50))
    assert res.requests == 50
    assert res.hit_tokens == 0
    assert res.max_hit_rate == 0
    assert res.computed_tokens == res.input_tokens > 0
    # the same 50 requests of the conversation trace do reuse: the zero is the transform's
    conv = run_replay(ReplayConfig(trace="conversation", limit=50))
    assert conv.input_tokens == res.input_tokens
    assert conv.max_hit_rate > 0


def test_unique_hash_ids_rejects_ids_beyond_int64() -> None:
    reqs = [TraceRequest(0.0, 1024, 1, (7, 8))]
    assert unique_hash_ids(reqs, base=5)[0].hash_ids == (5, 6)
    with pytest.raises(ValueError, match="do not fit int64"):
        unique_hash_ids(reqs, base=2**63 - 1)


# ------------------------------------------------------------------------------ reuse windows

# Offloaded blocks of 512 tokens, identity (hash id, position). r2's second block is partial,
# so it is never cached: r3 after r2 alone hits only its first block.
HAND = [
    TraceRequest(0.0, 1024, 1, (1, 2)),  # nothing shared
    TraceRequest(1.0, 1024, 1, (3, 4)),
    TraceRequest(2.0, 1000, 1, (3, 4)),  # 1 full block: (3, 0) hits after r1
    TraceRequest(3.0, 1300, 1, (3, 4, 5)),  # 2 full: (3, 0), (4, 1) hit after r1
    TraceRequest(4.0, 512, 1, (9,)),
]


def test_hand_built_windows_of_three() -> None:
    assert reuse_windows(HAND, 3) == [
        ReuseWindow(0, 3, 1024 + 1024 + 1000, 512),
        ReuseWindow(1, 4, 1024 + 1000 + 1300, 512 + 1024),
        ReuseWindow(2, 5, 1000 + 1300 + 512, 512),
    ]
    assert best_reuse_window(HAND, 3) == (1, 1536 / 3324)


def test_hand_built_windows_of_two_and_stride() -> None:
    assert [w.reuse_tokens for w in reuse_windows(HAND, 2)] == [0, 512, 512, 0]
    assert best_reuse_window(HAND, 2) == (1, 512 / 2024)
    # stride 2 tries the starts 0 and 2 only
    assert [w.start for w in reuse_windows(HAND, 2, 2)] == [0, 2]
    assert best_reuse_window(HAND, 2, stride=2) == (2, 512 / 2300)
    # the whole trace as one window
    assert reuse_windows(HAND, 5) == [ReuseWindow(0, 5, 4860, 512 + 1024)]


def test_hand_built_window_matches_the_replay_maximum() -> None:
    start, fraction = best_reuse_window(HAND, 3)
    res = run_replay(ReplayConfig(trace="conversation"), requests=HAND[start : start + 3])
    assert res.max_hit_rate == pytest.approx(fraction)


def test_block_size_counts_whole_offloaded_blocks() -> None:
    # 1024-token offloaded blocks, keyed by the hash id of their last token's trace block: r1
    # and r3 have one full block (4, 0), r2 (1000 tokens) none: only r3 after r1 hits
    assert [w.reuse_tokens for w in reuse_windows(HAND, 3, block_size=1024)] == [0, 1024, 0]


def test_conversation_best_window_beats_the_first(conversation: list[TraceRequest]) -> None:
    first = reuse_windows(conversation, 200, len(conversation))
    assert len(first) == 1
    start, fraction = best_reuse_window(conversation, 200)
    assert fraction >= first[0].reuse_fraction
    assert (start, round(fraction, 4)) == (1164, 0.1485)
    # a coarser stride finds at most as good a window, at a multiple of the stride
    start50, fraction50 = best_reuse_window(conversation, 200, stride=50)
    assert start50 % 50 == 0
    assert first[0].reuse_fraction <= fraction50 <= fraction


def test_conversation_best_window_matches_its_replay(conversation: list[TraceRequest]) -> None:
    start, fraction = best_reuse_window(conversation, 50)
    res = run_replay(ReplayConfig(trace="conversation"), requests=conversation[start : start + 50])
    assert res.max_hit_rate == pytest.approx(fraction)
    assert fraction > 0


def test_reuse_windows_is_fast(conversation: list[TraceRequest]) -> None:
    t0 = time.perf_counter()
    wins = reuse_windows(conversation, 500, 50)
    assert time.perf_counter() - t0 < 1.0
    assert len(wins) == (len(conversation) - 500) // 50 + 1
    assert [w.start for w in wins[:3]] == [0, 50, 100]


@pytest.mark.parametrize(
    ("window", "stride", "match"),
    [
        (0, 1, "window must be an integer >= 1, got 0"),
        (-3, 1, "window must be an integer >= 1, got -3"),
        (2, 0, "stride must be an integer >= 1, got 0"),
        (6, 1, r"window=6 requests is longer than the trace \(5 requests\); give a window of at "
         "most 5"),
    ],
)  # fmt: skip
def test_bad_windows_raise(window: int, stride: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        reuse_windows(HAND, window, stride)
    with pytest.raises(ValueError, match=match):
        best_reuse_window(HAND, window, stride=stride)


def test_bad_block_sizes_and_short_hash_ids_raise() -> None:
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        reuse_windows(HAND, 2, block_size=0)
    with pytest.raises(ValueError, match="trace_block_size must be an integer >= 1, got 0"):
        reuse_windows(HAND, 2, trace_block_size=0)
    with pytest.raises(ValueError, match="request 0: input_length=1024 needs 2 hash ids"):
        reuse_windows([TraceRequest(0.0, 1024, 1, (1,))], 1)
    with pytest.raises(ValueError, match="longer than the trace"):
        reuse_windows([], 1)
