"""The worker's job table (kvoff.job_table), driven directly. The CUDA half (jobs in flight until
their end event passes) runs here with stand-in events and streams, so its bookkeeping is
checked on every machine; tests/test_ops_cuda.py and tests/test_worker.py drive it with real
CUDA events on a GPU."""

from __future__ import annotations

from typing import Any

import pytest

from kvoff.job_table import JobTable, byte_shares
from kvoff.jobs import TransferResult


class _Event:
    """Stands in for torch.cuda.Event: passed once ``done`` is set; ``ms`` after ``start``."""

    def __init__(self, ms: float = 0.0) -> None:
        self.done = False
        self.ms = ms
        self.synchronized = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True

    def elapsed_time(self, end: _Event) -> float:
        return end.ms - self.ms


class _Stream:
    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


def _ok(job_id: int) -> TransferResult:
    return TransferResult(job_id, "store", True, 10, 0.5, None, "cpu")


def _launched(table: JobTable, members: list[tuple[int, int]], ms: float = 8.0) -> _Event:
    end = _Event(ms)
    table.launch(members, "load", "batch", _Event(0.0), end)  # type: ignore[arg-type]
    return end


def test_byte_shares_split_by_bytes_and_equally_when_nothing_moved() -> None:
    assert byte_shares([1, 3]) == [0.25, 0.75]
    assert byte_shares([0, 0, 0]) == [1 / 3] * 3
    assert byte_shares([]) == []


def test_a_job_is_pending_until_its_result_is_taken() -> None:
    t = JobTable()
    t.finish(_ok(1))
    t.fail([2, 3], "load", "bad id")
    end = _launched(t, [(4, 100)])
    assert t.pending() == {1, 2, 3, 4}
    assert all(t.is_pending(j) for j in (1, 2, 3, 4)) and not t.is_pending(5)
    first = t.take_finished()  # job 4's end has not passed: it stays in flight
    assert [(r.job_id, r.success, r.error) for r in first] == [
        (1, True, None),
        (2, False, "bad id"),
        (3, False, "bad id"),
    ]
    assert t.pending() == {4}
    end.done = True
    (r,) = t.take_finished()
    assert (r.job_id, r.direction, r.success, r.num_bytes, r.mechanism) == (
        4,
        "load",
        True,
        100,
        "batch",
    )
    assert r.seconds == pytest.approx(0.008)
    assert t.pending() == set() and t.take_finished() == []


def test_jobs_of_one_submission_share_its_time_by_bytes() -> None:
    t = JobTable()
    _launched(t, [(1, 100), (2, 300)], ms=4.0).done = True
    times = {r.job_id: r.seconds for r in t.take_finished()}
    assert times == {1: pytest.approx(0.001), 2: pytest.approx(0.003)}


def test_wait_blocks_on_jobs_in_flight_and_leaves_the_others_queued() -> None:
    t = JobTable()
    end = _launched(t, [(1, 64)])
    other = _launched(t, [(2, 64)])
    t.finish(_ok(3))
    results = t.wait([3, 1])
    assert [r.job_id for r in results] == [3, 1]
    assert end.synchronized == 1 and other.synchronized == 0
    assert t.pending() == {2}


def test_wait_refuses_repeats_and_unknown_ids_and_takes_nothing() -> None:
    t = JobTable()
    end = _launched(t, [(1, 64)])
    t.finish(_ok(2))
    with pytest.raises(ValueError, match=r"job ids \[2\] are given more than once"):
        t.wait([2, 1, 2])
    with pytest.raises(KeyError, match=r"unknown job ids \[9\].*nothing was taken"):
        t.wait([1, 9])
    assert t.pending() == {1, 2} and end.synchronized == 0


def test_fence_makes_the_stream_wait_on_jobs_in_flight_only() -> None:
    t = JobTable()
    end = _launched(t, [(1, 64), (2, 64)])
    t.finish(_ok(3))
    stream = _Stream()
    assert t.fence([1, 2, 3, 1], stream, None) == 2  # type: ignore[arg-type]
    assert stream.waited == [end, end]
    assert t.fence([3], stream, None) == 0  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"unknown job ids \[7\].*nothing was ordered"):
        t.fence([1, 7], stream, None)  # type: ignore[arg-type]
    assert len(stream.waited) == 2
    assert t.pending() == {1, 2, 3}  # a fence takes no result
    assert end.synchronized == 0  # nor blocks the host


def test_drain_waits_for_every_job_and_keeps_their_results_queued() -> None:
    t = JobTable()
    t.finish(_ok(1))
    end = _launched(t, [(2, 64)])
    t.drain()
    assert end.synchronized == 1
    assert [r.job_id for r in t.take_finished()] == [1, 2]
    t.drain()  # nothing in flight: nothing to do
    assert t.pending() == set()


def test_results_left_by_wait_stay_in_finishing_order_and_a_taken_id_is_free_again() -> None:
    t = JobTable()
    for j in (5, 1, 4, 2):
        t.finish(_ok(j))
    assert [r.job_id for r in t.wait([4])] == [4]
    assert not t.is_pending(4) and t.is_pending(2)
    t.finish(_ok(4))  # the id may be used again once its result was taken
    assert [r.job_id for r in t.take_finished()] == [5, 1, 2, 4]
    assert t.pending() == set()
