"""The records of :mod:`scheduler_harness`'s engine simulator: the model's groups and the
:class:`kvoff.CPUOffloadingSpec` they make (:func:`build_spec`), a simulated request
(:class:`SimRequest`), a job in flight (:class:`JobRec`), what one step did
(:class:`StepRecord`), and :class:`HarnessViolation`, which every broken rule raises."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvoff import CPUOffloadingSpec
from kvoff.scheduler import (
    ConnectorMetadata,
    ConnectorOutput,
    OffloadingScheduler,
    Request,
    ScheduledRequest,
    TransferJob,
)
from kvoff.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)

Kind = Literal["full", "sliding_window", "mamba"]
Pos = tuple[int, int]  # (group, logical GPU block position)


class HarnessViolation(AssertionError):
    """An invariant the simulator checks was broken (a scheduler bug, or a harness bug)."""


@dataclass(frozen=True)
class GroupDesc:
    """One KV cache group of the simulated model.

    Attributes:
        kind: ``"full"``, ``"sliding_window"`` or ``"mamba"``.
        sliding_window: window in tokens (sliding-window groups only).
        num_layers: layers in the group (each gets its own tensor and its own pattern).
    """

    kind: Kind = "full"
    sliding_window: int = 0
    num_layers: int = 1


def build_spec(
    groups: Sequence[GroupDesc],
    *,
    block_size: int,
    num_gpu_blocks: int,
    num_cpu_blocks: int,
    block_size_factor: int = 1,
    hash_block_size: int | None = None,
    world_size: int = 1,
    eviction_policy: str = "lru",
) -> tuple[CPUOffloadingSpec, dict[str, tuple[int, int]]]:
    """A :class:`CPUOffloadingSpec` for ``groups`` with exactly ``num_cpu_blocks`` CPU slots.

    Returns:
        The spec and, per layer name, ``(group index, layer index within the group)``.
    """
    group_specs = []
    tensors = []
    layers: dict[str, tuple[int, int]] = {}
    for g, desc in enumerate(groups):
        if desc.kind == "full":
            spec: object = FullAttentionSpec(block_size, 1, 4, torch.float16)
        elif desc.kind == "sliding_window":
            spec = SlidingWindowSpec(block_size, 1, 4, torch.float16, desc.sliding_window)
        else:
            spec = MambaSpec(block_size, ((3, 4),), (torch.float16,))
        names = tuple(f"g{g}.l{i}" for i in range(desc.num_layers))
        for i, name in enumerate(names):
            layers[name] = (g, i)
            tensors.append(KVCacheTensor(num_gpu_blocks * spec.page_size_bytes, (name,)))
        group_specs.append(KVCacheGroupSpec(names, spec))
    config = KVCacheConfig(num_gpu_blocks, tensors, group_specs)
    per_block = config.total_bytes // num_gpu_blocks
    spec = CPUOffloadingSpec(
        config,
        cpu_bytes_to_use=num_cpu_blocks * per_block * block_size_factor * world_size,
        block_size=block_size * block_size_factor,
        hash_block_size=hash_block_size,
        world_size=world_size,
        eviction_policy=eviction_policy,
    )
    assert spec.num_blocks == num_cpu_blocks, (spec.num_blocks, num_cpu_blocks)
    return spec, layers


@dataclass
class SimRequest:
    """The engine's view of one request.

    Attributes:
        rid: request id.
        tokens: prompt followed by every output token it will generate (predetermined).
        prompt_len: prompt tokens.
        max_tokens: output tokens; the request finishes after sampling that many.
        chunk: prefill tokens per step (None: the whole remaining prompt).
        req: the object handed to the scheduler (``block_hashes``, ``num_tokens``).
        status: ``waiting`` (new or preempted), ``loading``, ``loaded`` (load finished or
            failed, to be scheduled), ``running``, ``kept`` (finished, blocks kept until its
            stores finish) or ``done``.
        computed: tokens whose KV is in the GPU cache.
        generated: output tokens sampled.
        known: tokens the scheduler knows (``req.num_tokens``).
        table: per group, block id per logical position (0 = null).
        gens: per group, the allocation generation of each table entry.
        hit: the engine's own GPU prefix hit at admission.
        load: ``(hit, hit + loaded tokens)`` while a load is pending or in flight.
        resumed: the next scheduling passes ``resumed_from_preemption=True``.
        scheduled_before: a block table was handed over since admission.
        cids: per logical GPU block position, the content id (chained token hash).
        hashes: every full hash block's chained hash over ``tokens``.
    """

    rid: str
    tokens: list[int]
    prompt_len: int
    max_tokens: int
    chunk: int | None
    req: Request
    status: str = "waiting"
    computed: int = 0
    generated: int = 0
    known: int = 0
    table: list[list[int]] = field(default_factory=list)
    gens: list[list[int]] = field(default_factory=list)
    hit: int = 0
    load: tuple[int, int] | None = None
    load_failed: bool = False
    resumed: bool = False
    scheduled_before: bool = False
    cids: list[bytes] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    appended: list[list[int]] = field(default_factory=list)
    pending_tokens: int = 0
    load_emitted: bool = False
    history: dict[Pos, tuple[int, int]] = field(default_factory=dict)
    flush_due: bool = False  # kept with no job in flight: a store of its waiting blocks is due
    flush_built: bool = False  # that step came and stored nothing: finished_storing lists it


@dataclass
class JobRec:
    """A job as the simulator tracks it (emitted, not yet completed by all ranks).

    Attributes:
        job: the scheduler's job.
        step: the step that emitted it.
        blocks: ``(group, position, block id, generation at emission)`` per GPU block.
        executed: its bytes moved already (flushed or completed).
        ranks: ranks that reported it.
        failed: a rank reported failure.
        stale: in flight at a reset_cache: a store's blocks never become hits.
    """

    job: TransferJob
    step: int
    blocks: list[tuple[int, int, int, int]]
    executed: bool = False
    ranks: set[int] = field(default_factory=set)
    failed: bool = False
    stale: bool = False


@dataclass
class StepRecord:
    """What happened in one step (scenarios assert on it).

    Attributes:
        step: step number (1-based).
        lookups: request id -> ``(num_computed_tokens, answer)`` of get_num_new_matched_tokens.
        meta: the scheduler's :class:`ConnectorMetadata`.
        loaded / stored: request id -> set of ``(group, position)`` in this step's load / store
            jobs.
        flushed: ``jobs_to_flush`` of the step.
        outputs: the :class:`ConnectorOutput` of every report delivery during the step.
        events: scheduler events taken during the step.
        scheduled: the :class:`ScheduledRequest` entries handed to the scheduler.
    """

    step: int
    lookups: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    meta: ConnectorMetadata = field(default_factory=ConnectorMetadata)
    loaded: dict[str, set[Pos]] = field(default_factory=dict)
    stored: dict[str, set[Pos]] = field(default_factory=dict)
    flushed: tuple[int, ...] = ()
    outputs: list[ConnectorOutput] = field(default_factory=list)
    events: list[object] = field(default_factory=list)
    scheduled: tuple[ScheduledRequest, ...] = ()

    @property
    def all_stored(self) -> set[tuple[str, int, int]]:
        """``(request, group, position)`` of every stored GPU block."""
        return {(r, g, p) for r, s in self.stored.items() for g, p in s}

    @property
    def all_loaded(self) -> set[tuple[str, int, int]]:
        """``(request, group, position)`` of every loaded GPU block."""
        return {(r, g, p) for r, s in self.loaded.items() for g, p in s}


def snapshot(sched: OffloadingScheduler, keys: Iterable[bytes], rids: Iterable[str]) -> tuple:
    """Scheduler state that a rejected call must leave unchanged: stats, per-key state, CPU id
    and pin count, per-request next store block."""
    return (
        sched.stats(),
        [(k, sched.block_state(k), sched.cpu_block_id(k), sched.pin_count(k)) for k in keys],
        [(r, sched.next_store_block(r)) for r in rids],
    )
