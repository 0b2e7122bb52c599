"""The worker's table of jobs: those still on the GPU (their CUDA events) and the results queued
for the engine to take (one job; the copies themselves are :mod:`kvoff.worker`'s).

A job is *pending* from its submission until its result is taken, by
:meth:`JobTable.take_finished` or :meth:`JobTable.wait`: in flight (CUDA, its end event not yet
passed) or finished with its result queued (every CPU job, a failed job, a CUDA job seen done).
A job id may be used again once its result was taken.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvoff.jobs import TransferResult
from kvoff.transfer import Direction

__all__ = ["InFlight", "JobTable", "byte_shares"]


def byte_shares(byte_counts: Sequence[int]) -> list[float]:
    """Each job's share of one submission's time, by its bytes (equal shares when none moved;
    none for no job).

    Args:
        byte_counts: bytes of each job of the submission.
    """
    total = sum(byte_counts)
    return [nb / total if total else 1 / len(byte_counts) for nb in byte_counts]


@dataclass
class InFlight:
    """A CUDA job between its submission and the end of its copies.

    ``num_bytes``: bytes the job moves; ``mechanism``: the mechanisms it used, ``"+"``-joined;
    ``start`` / ``end``: timing events around its submission's copies (shared by the jobs of
    one :meth:`kvoff.worker.OffloadingWorker.transfer_many_async` call); ``share``: this job's
    part of that submission's bytes (:func:`byte_shares`), which scales the events' time."""

    job_id: int
    direction: Direction
    num_bytes: int
    mechanism: str
    start: torch.cuda.Event
    end: torch.cuda.Event
    share: float = 1.0


class JobTable:
    """Pending jobs of one :class:`kvoff.worker.OffloadingWorker`, and their results. Not
    thread-safe (the worker's caller is one thread: the engine's)."""

    def __init__(self) -> None:
        # Keyed by job id (an id is pending at most once), in the order the jobs finished.
        self._finished: dict[int, TransferResult] = {}
        self._in_flight: dict[int, InFlight] = {}

    def is_pending(self, job_id: int) -> bool:
        """Whether ``job_id`` is in flight or has a result not taken yet."""
        return job_id in self._in_flight or job_id in self._finished

    def pending(self) -> set[int]:
        """Ids of the jobs in flight or with a result not taken yet."""
        return set(self._in_flight) | set(self._finished)

    def finish(self, result: TransferResult) -> None:
        """Queue the result of a job that ran to its end here (CPU, or failed before copying)."""
        self._finished[result.job_id] = result

    def fail(
        self, job_ids: Iterable[int], direction: Direction, error: str, mechanism: str = "cpu"
    ) -> None:
        """Queue a failed :class:`TransferResult` (nothing moved, 0 s) for each of ``job_ids``."""
        for job_id in job_ids:
            self._finished[job_id] = TransferResult(
                job_id, direction, False, 0, 0.0, error, mechanism
            )

    def launch(
        self,
        members: Sequence[tuple[int, int]],
        direction: Direction,
        mechanism: str,
        start: torch.cuda.Event,
        end: torch.cuda.Event,
    ) -> None:
        """Record the jobs of one CUDA submission, ``(job id, bytes)`` each, as in flight until
        ``end`` has passed; each is timed by its bytes' share of ``start`` → ``end``."""
        shares = byte_shares([num_bytes for _, num_bytes in members])
        for (job_id, num_bytes), share in zip(members, shares, strict=True):
            self._in_flight[job_id] = InFlight(
                job_id, direction, num_bytes, mechanism, start, end, share
            )

    def _complete(self, job: InFlight) -> TransferResult:
        del self._in_flight[job.job_id]
        seconds = job.start.elapsed_time(job.end) / 1e3 * job.share
        return TransferResult(
            job.job_id, job.direction, True, job.num_bytes, seconds, None, job.mechanism
        )

    def take_finished(self) -> list[TransferResult]:
        """The queued results and those of the jobs in flight whose end event has passed
        (polled, never waited for); all of them are taken."""
        done = list(self._finished.values())
        self._finished = {}
        for job in list(self._in_flight.values()):
            if job.end.query():
                done.append(self._complete(job))
        return done

    def check_known(self, job_ids: Iterable[int], unchanged: str) -> None:
        """Raises:
        KeyError: naming the ids neither in flight nor with a result queued; ``unchanged``
            ends the message (what the caller left as it was)."""
        missing = [j for j in job_ids if j not in self._in_flight and j not in self._finished]
        if missing:
            raise KeyError(
                f"unknown job ids {missing}: never submitted, or their results were already "
                f"taken; {unchanged}"
            )

    def fence(
        self,
        job_ids: Iterable[int],
        stream: torch.cuda.Stream | None,
        device: torch.device | None,
    ) -> int:
        """Make ``stream`` (default: ``device``'s current stream) wait on the end events of
        those of ``job_ids`` still in flight, without blocking the host; returns their number
        (a job given twice counts once).

        Raises:
            KeyError: an id not pending (never submitted, or its result taken; :meth:`check_known`);
                nothing is queued then.
        """
        wanted = dict.fromkeys(job_ids)
        self.check_known(wanted, "nothing was ordered")
        jobs = [self._in_flight[j] for j in wanted if j in self._in_flight]
        if not jobs:
            return 0
        if stream is None:
            stream = torch.cuda.current_stream(device)
        for job in jobs:
            stream.wait_event(job.end)
        return len(jobs)

    def wait(self, job_ids: Iterable[int]) -> list[TransferResult]:
        """Block until the given jobs are finished and take their results, in the given order;
        other jobs' results stay queued.

        Raises:
            KeyError: an id not pending (never submitted, or its result taken; :meth:`check_known`);
                nothing is taken then.
            ValueError: an id given more than once; nothing is taken.
        """
        wanted = list(job_ids)
        if len(set(wanted)) != len(wanted):
            seen: set[int] = set()
            repeated = sorted({j for j in wanted if j in seen or seen.add(j)})
            raise ValueError(
                f"job ids {repeated} are given more than once; list each job once (its result "
                "is reported once); nothing was taken"
            )
        self.check_known(wanted, "nothing was taken")
        results: dict[int, TransferResult] = {}
        for jid in wanted:
            job = self._in_flight.get(jid)
            if job is not None:
                job.end.synchronize()
                results[jid] = self._complete(job)
        for jid in wanted:
            if jid not in results:
                results[jid] = self._finished.pop(jid)
        return [results[j] for j in wanted]

    def drain(self) -> None:
        """Block until every job in flight is finished; their results stay queued, as if they
        had finished alone."""
        if self._in_flight:
            for result in self.wait(list(self._in_flight)):
                self._finished[result.job_id] = result
