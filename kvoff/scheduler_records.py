"""The offloading scheduler's records: what the engine gives it each step and what it hands to
the workers (:mod:`kvoff.scheduler` has the hooks that read and make them)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from kvoff.checks import check_flag
from kvoff.jobs import CPUBlockSpec, GPUBlockSpec

__all__ = [
    "ConnectorMetadata",
    "ConnectorOutput",
    "FinishState",
    "JobReport",
    "Request",
    "RequestLike",
    "ScheduledRequest",
    "SchedulerStep",
    "TransferJob",
]


class RequestLike(Protocol):
    """What the scheduler reads from an engine's request object (any object with these)."""

    @property
    def request_id(self) -> str:
        """The engine's id of the request, unique while it lives."""
        ...

    @property
    def block_hashes(self) -> Sequence[bytes | int]:
        """One hash per full hash block of the prompt and output so far (``hash_block_size``
        tokens each), in order: non-empty bytes (vLLM's ``BlockHash``) or 64-bit ints."""
        ...

    @property
    def num_tokens(self) -> int:
        """Tokens of the request so far (prompt + output), >= what the hashes cover."""
        ...

    # With offload_prompt_only the scheduler also reads ``num_prompt_tokens`` (an int >= 0,
    # or None for "unknown": nothing limited): the prompt's length in tokens (vLLM's Request
    # has it). Not part of the protocol, so objects without it still satisfy it where the
    # option is off.


@dataclass
class Request:
    """A request as the scheduler sees it; the engine keeps it up to date as tokens arrive.

    Mutable on purpose: ``block_hashes`` and ``num_tokens`` grow while the request runs.

    Attributes:
        request_id: unique while the request lives.
        block_hashes: one chained prefix hash (bytes, or an int in ``[-2**63, 2**64)``) per
            full ``hash_block_size`` tokens of the known tokens, oldest first.
        num_tokens: known tokens (prompt + generated so far); with async scheduling tokens
            scheduled but not yet sampled are not counted. Must be
            ``>= len(block_hashes) * hash_block_size``.
        num_prompt_tokens: the prompt's length in tokens, read with ``offload_prompt_only``
            (:class:`OffloadingScheduler`); ``None``: unknown, nothing is limited.
    """

    request_id: str
    block_hashes: list[bytes | int] = field(default_factory=list)
    num_tokens: int = 0
    num_prompt_tokens: int | None = None


@dataclass(frozen=True)
class ScheduledRequest:
    """One scheduled request of a step.

    Attributes:
        request_id: the request.
        new_block_ids: per KV cache group, the GPU block ids newly allocated to the request
            this step (appended to its block table), in logical order; for a request scheduled
            for the first time, or resumed from preemption, its whole block table. Null blocks
            (id 0) mark positions the group does not keep. ``()`` means no new blocks.
        num_computed_tokens: tokens computed before this step.
        num_scheduled_tokens: tokens computed in this step.
        resumed_from_preemption: the request was preempted and ``new_block_ids`` is its new
            whole table.

    Raises:
        TypeError: ``new_block_ids`` is not a sequence of sequences of ints (a float, a str or
            a bool as a block id); ``resumed_from_preemption`` is not a bool (``"False"`` would
            read as True and replace the request's block table with ``new_block_ids``).
    """

    request_id: str
    new_block_ids: tuple[tuple[int, ...], ...] = ()
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0
    resumed_from_preemption: bool = False

    def __post_init__(self) -> None:
        if self.resumed_from_preemption.__class__ is not bool:  # one test on the common path
            check_flag("resumed_from_preemption", self.resumed_from_preemption)
        object.__setattr__(self, "new_block_ids", _block_id_table(self.new_block_ids))


def _block_id_table(table: Any) -> tuple[tuple[int, ...], ...]:
    """``ScheduledRequest.new_block_ids`` as tuples of ints, checked: ``int(1.9)`` would give
    block 1 and a store job would copy it under another block's offload key.

    Raises:
        TypeError: ``table`` is not a sequence of sequences, or an id is not an int (a float, a
            str or a bool).
    """
    try:
        groups = tuple(table)
    except TypeError:
        raise TypeError(
            f"new_block_ids must be a sequence of block id sequences, one per KV cache group, "
            f"got {table!r}"
        ) from None
    out = []
    for g, ids in enumerate(groups):
        try:
            items = tuple(ids)
        except TypeError:
            raise TypeError(
                f"new_block_ids[{g}] must be a sequence of GPU block ids, got {ids!r}"
            ) from None
        for i, b in enumerate(items):
            if isinstance(b, bool) or not hasattr(b, "__index__"):
                raise TypeError(
                    f"new_block_ids[{g}][{i}] must be an int GPU block id, got {b!r} "
                    f"({type(b).__name__})"
                )
        out.append(tuple(map(operator.index, items)))
    return tuple(out)


@dataclass(frozen=True)
class SchedulerStep:
    """The scheduling output of one engine step, as the offloading scheduler needs it.

    Attributes:
        scheduled: every request scheduled in this step.
        finished_request_ids: requests finished or aborted since the last step.
        preempted_request_ids: requests preempted in this step (their GPU blocks are freed).
        rewritten_block_ids: GPU blocks the engine overwrites in this step that are not among
            the scheduled requests' new blocks (copy-on-write destinations, zeroed blocks): an
            in-flight job using one is flushed and a remembered id is stale (invariant 4).
    """

    scheduled: tuple[ScheduledRequest, ...] = ()
    finished_request_ids: tuple[str, ...] = ()
    preempted_request_ids: tuple[str, ...] = ()
    rewritten_block_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheduled", tuple(self.scheduled))
        object.__setattr__(self, "finished_request_ids", tuple(self.finished_request_ids))
        object.__setattr__(self, "preempted_request_ids", tuple(self.preempted_request_ids))
        object.__setattr__(self, "rewritten_block_ids", tuple(self.rewritten_block_ids))


@dataclass(frozen=True)
class TransferJob:
    """One load (CPU→GPU) or store (GPU→CPU) job for every rank's worker.

    Attributes:
        job_id: unique for the scheduler's lifetime; pass it to the worker and report it back.
        request_id: the request the job belongs to.
        direction: ``"load"`` or ``"store"``.
        gpu: the GPU side (block ids of all groups in group order, ``group_sizes``,
            ``block_indices``; docs/design.md invariant 1).
        cpu: the CPU side (CPU block ids, group by group).
        keys: the offload key of each CPU block, same order as ``cpu.block_ids``.
    """

    job_id: int
    request_id: str
    direction: Literal["load", "store"]
    gpu: GPUBlockSpec
    cpu: CPUBlockSpec
    keys: tuple[bytes, ...]

    @property
    def src(self) -> GPUBlockSpec | CPUBlockSpec:
        """The side copied from (``OffloadingWorker.transfer_async(job_id, src, dst)``)."""
        return self.gpu if self.direction == "store" else self.cpu

    @property
    def dst(self) -> GPUBlockSpec | CPUBlockSpec:
        """The side copied to."""
        return self.cpu if self.direction == "store" else self.gpu


@dataclass(frozen=True)
class ConnectorMetadata:
    """What :meth:`OffloadingScheduler.build_connector_meta` hands to the workers.

    Attributes:
        load_jobs: loads to submit before the forward pass.
        store_jobs: stores to submit after it (they wait on the compute stream).
        jobs_to_flush: in-flight job ids whose GPU blocks were reallocated this step: wait for
            them (``OffloadingWorker.wait``) before the forward pass writes (docs/design.md
            invariant 4). Their results must still be reported.
    """

    load_jobs: tuple[TransferJob, ...] = ()
    store_jobs: tuple[TransferJob, ...] = ()
    jobs_to_flush: tuple[int, ...] = ()


@dataclass(frozen=True)
class JobReport:
    """One rank's result for one job (``kvoff.TransferResult`` carries the same fields)."""

    job_id: int
    success: bool = True


class FinishState(NamedTuple):
    """Why a finished request's GPU blocks should stay
    (:meth:`OffloadingScheduler.request_finished_state`).

    Attributes:
        jobs_in_flight: loads or stores of the request are in flight; an engine that frees the
            blocks anyway is safe (the next step that reuses them flushes those jobs).
        store_due: store batching: its blocks that waited for a full batch are stored by the
            next step; blocks the engine reuses before that step are not stored.
    """

    jobs_in_flight: bool
    store_due: bool


@dataclass(frozen=True)
class ConnectorOutput:
    """What :meth:`OffloadingScheduler.update_connector_output` concluded.

    Attributes:
        finished_loading: requests whose loads all succeeded on every rank: schedule them.
        failed_loading: requests with a failed load: recompute the tokens that were to be
            loaded (from the engine's own hit on).
        finished_storing: finished requests whose last in-flight job (load or store)
            completed — exactly those for which :meth:`OffloadingScheduler.request_finished`
            returned True: free their GPU blocks now.
        completed_jobs: jobs completed by this call (reported by all ranks).
        failed_jobs: the completed jobs that failed on at least one rank.
    """

    finished_loading: tuple[str, ...] = ()
    failed_loading: tuple[str, ...] = ()
    finished_storing: tuple[str, ...] = ()
    completed_jobs: tuple[int, ...] = ()
    failed_jobs: tuple[int, ...] = ()
