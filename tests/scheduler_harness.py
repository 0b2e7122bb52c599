"""An engine simulator that drives :class:`kvoff.scheduler.OffloadingScheduler` step by step.

The simulator plays the engine of docs/design.md "One engine step" and moves real bytes through a
:class:`kvoff.OffloadingWorker` (CPU tensors), so tests can assert both the scheduler's decisions
(which ``(group, logical block position)`` pairs are stored or loaded, which jobs are flushed)
and that every byte that comes back from the CPU pool is the byte that was computed.

Engine model (documented because the scheduler's contract depends on it):

* GPU blocks ``1 .. num_gpu_blocks - 1`` are handed out from a LIFO free list (block 0 is the
  null block), so a freed block is the next one reused. Every allocation bumps the block's
  *generation*; a job remembers the generation of each block it touches.
* Every request has one block table per KV cache group. Allocation is per logical position in
  every group. Before a running request is scheduled, blocks it no longer needs are freed and
  replaced by 0 in its table: sliding-window blocks wholly before ``computed - W + 1``, and for
  Mamba groups every block before the one holding the latest full-block state (position
  ``computed // block_size - 1``). A request admitted with ``N`` cached tokens gets null
  entries at those positions from the start.
* Mamba engine contract: the block at position ``p`` holds the state after the last token of
  block ``p`` once that block is full (the simulator writes every position a step touches).
* The "forward pass" writes a deterministic pattern into every GPU block a step computes:
  ``pattern(content id of the block, group, layer)``, the content id being a chained hash of
  the request's tokens up to the end of that block. Equal prefixes give equal bytes, so a block
  stored by one request and loaded by another must come back byte for byte.
* Jobs are executed lazily (the worst case of asynchrony): a job's bytes move when it is
  flushed (``jobs_to_flush``: the engine waits for it before writing) or when the test
  completes it, FIFO within a direction like the worker's streams. A store checks its source
  blocks hold the pattern of the positions it claims; a load checks its destination blocks
  afterwards. A job in flight is assumed to run concurrently with everything emitted later,
  so a later write to one of its blocks by a newer allocation (the forward pass, or a job of
  the other direction) without a flush is a fence violation.
* Optional GPU prefix cache (full-attention-only models): full blocks are cached by content id,
  freed blocks keep their entry until reallocated; a new request's ``num_computed_tokens`` is
  its cached prefix (at most ``num_tokens - 1``). Off: ``num_computed_tokens = 0``.
* Async scheduling: tokens sampled in step ``s`` reach the request (``num_tokens``,
  ``block_hashes``) only after step ``s + 1``'s ``build_connector_meta``.
* A request that waits for a load is not scheduled; once its load finishes it is scheduled with
  its whole table (``num_computed_tokens`` = hit, minus one token when the hit covers every
  known token). A failed load is recomputed from the engine's own hit.
* Preemption frees every block at once; the request is looked up again and resumes with a new
  whole table (``resumed_from_preemption=True``). Out of blocks, the last running request is
  preempted. A finished or aborted request for which ``request_finished`` returned True keeps
  its blocks until ``finished_storing`` names it (``free_early=True`` frees at once instead).

Every violation raises :class:`HarnessViolation` (an ``AssertionError``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch
from scheduler_sim_records import (
    GroupDesc,
    HarnessViolation,
    JobRec,
    SimRequest,
    StepRecord,
    build_spec,
    snapshot,
)

from kvoff import OffloadingWorker
from kvoff.node_pool import NodePoolClient
from kvoff.scheduler import (
    ConnectorOutput,
    OffloadingScheduler,
    Request,
    ScheduledRequest,
    SchedulerStep,
    TransferJob,
)

__all__ = [
    "EngineSim",
    "GroupDesc",
    "HarnessViolation",
    "JobRec",
    "SimRequest",
    "StepRecord",
    "build_spec",
    "snapshot",
]


def _h(*parts: bytes) -> bytes:
    return hashlib.blake2b(b"|".join(parts), digest_size=16).digest()


def _tok_bytes(tokens: Sequence[int]) -> bytes:
    return b"".join(int(t).to_bytes(4, "little") for t in tokens)


class EngineSim:
    """A simulated engine around one :class:`OffloadingScheduler` and one worker.

    Args:
        groups: the model's KV cache groups.
        block_size: tokens per GPU block.
        num_gpu_blocks: GPU blocks including the null block 0.
        num_cpu_blocks: CPU pool slots.
        block_size_factor: GPU blocks per offloaded block.
        hash_block_size: tokens per block hash (None: the block size).
        world_size: simulated ranks (each job is reported once per rank).
        gpu_prefix_cache: the engine's own prefix cache (full-attention-only models).
        async_scheduling: sampled tokens reach the scheduler one step late.
        auto_complete: every in-flight job completes (all ranks, success) at the end of each
            step; otherwise tests call :meth:`complete`.
        free_early: free a finished request's blocks at once even when jobs are in flight.
        enable_events: record scheduler events (the harness tracks ready keys through them).
        eviction_policy: CPU pool eviction policy.
        store_batch_blocks: the scheduler's store batching.
        store_threshold: the scheduler's store admission (offers before a block is stored).
        node_pool: a node pool's client: the scheduler's CPU pool is the node pool (its slot
            count must be ``num_cpu_blocks``), and the worker maps its region.
    """

    def __init__(
        self,
        groups: Sequence[GroupDesc] = (GroupDesc(),),
        *,
        block_size: int = 4,
        num_gpu_blocks: int = 64,
        num_cpu_blocks: int = 16,
        block_size_factor: int = 1,
        hash_block_size: int | None = None,
        world_size: int = 1,
        gpu_prefix_cache: bool = False,
        async_scheduling: bool = False,
        auto_complete: bool = True,
        free_early: bool = False,
        enable_events: bool = True,
        eviction_policy: str = "lru",
        store_batch_blocks: int = 1,
        store_threshold: int = 0,
        node_pool: NodePoolClient | None = None,
    ) -> None:
        self.groups = tuple(groups)
        if gpu_prefix_cache and any(g.kind != "full" for g in self.groups):
            raise ValueError("the simulated GPU prefix cache supports full-attention models only")
        self.bs = block_size
        self.f = block_size_factor
        self.hbs = hash_block_size or block_size
        self.world_size = world_size
        self.num_gpu_blocks = num_gpu_blocks
        self.gpu_prefix_cache = gpu_prefix_cache
        self.async_scheduling = async_scheduling
        self.auto_complete = auto_complete
        self.free_early = free_early
        self.enable_events = enable_events
        self.spec, self.layers = build_spec(
            self.groups,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            block_size_factor=block_size_factor,
            hash_block_size=hash_block_size,
            world_size=world_size,
            eviction_policy=eviction_policy,
        )
        self.sched = OffloadingScheduler(
            self.spec,
            enable_events=enable_events,
            store_batch_blocks=store_batch_blocks,
            store_threshold=store_threshold,
            node_pool=node_pool,
        )
        self.worker = OffloadingWorker.from_spec(
            self.spec,
            pin_memory=False,
            shared_memory_name=None if node_pool is None else node_pool.regions[0],
            attach_shared_memory=node_pool is not None,
        )
        caches: dict[str, torch.Tensor] = {}
        self.rows: dict[str, torch.Tensor] = {}  # layer -> (num_gpu_blocks, page) uint8 view
        for name, (g, _) in self.layers.items():
            if self.groups[g].kind == "mamba":
                t = torch.zeros((num_gpu_blocks, 24), dtype=torch.uint8)
                caches[name] = t
                self.rows[name] = t
            else:
                t = torch.zeros((num_gpu_blocks, 2, block_size, 1, 4), dtype=torch.float16)
                caches[name] = t
                self.rows[name] = t.view(torch.uint8).view(num_gpu_blocks, -1)
        self.worker.register_kv_caches(caches)
        self.group_layers = [
            [n for n, (g2, _) in self.layers.items() if g2 == g] for g in range(len(self.groups))
        ]
        # GPU block pool
        self.free: list[int] = list(range(num_gpu_blocks - 1, 0, -1))  # pop() gives 1 first
        self.refcnt = [0] * num_gpu_blocks
        self.gen = [0] * num_gpu_blocks
        self.written_gen = [0] * num_gpu_blocks
        # allocation generation of each block as last announced to the scheduler (a block in a
        # ScheduledRequest's new_block_ids or a load job's destination): an allocation the
        # scheduler has not been told about yet has not been written either
        self.announced_gen = [0] * num_gpu_blocks
        self.cache: dict[tuple[bytes, int], int] = {}  # prefix cache: (cid, group) -> block
        self.cached_as: dict[int, tuple[bytes, int]] = {}
        # requests and jobs
        self.requests: dict[str, SimRequest] = {}
        self.order: list[str] = []  # admission order of live requests
        self.jobs: dict[int, JobRec] = {}  # in flight (emitted, not completed)
        self.executed_ids: set[int] = set()
        self.step_no = 0
        self.records: list[StepRecord] = []
        self.rec: StepRecord | None = None
        self._scheduled: list[ScheduledRequest] = []
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        self._unpublished: list[tuple[str, int]] = []  # async: (rid, known tokens) to publish
        self.ready_keys: set[bytes] = set()  # from events
        self._patterns: dict[tuple[bytes, int, int], torch.Tensor] = {}
        self.check_tables = True  # emission-time table checks (self-tests turn them off)
        self.violations: list[str] = []

    # ------------------------------------------------------------------ helpers
    def fail(self, msg: str) -> None:
        """Record and raise a violation."""
        self.violations.append(msg)
        raise HarnessViolation(f"step {self.step_no}: {msg}")

    def pattern(self, cid: bytes, g: int, layer: str) -> torch.Tensor:
        """The bytes a block of content ``cid`` holds in layer ``layer`` of group ``g``."""
        key = (cid, g, self.layers[layer][1])
        pat = self._patterns.get(key)
        if pat is None:
            n = self.rows[layer].shape[1]
            digest = _h(cid, bytes([g, self.layers[layer][1]]))
            raw = (digest * (n // len(digest) + 1))[:n]
            pat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            self._patterns[key] = pat
        return pat

    def block_matches(self, block: int, g: int, cid: bytes) -> bool:
        """Whether GPU block ``block`` holds the pattern of ``cid`` in every layer of ``g``."""
        return all(
            torch.equal(self.rows[n][block], self.pattern(cid, g, n)) for n in self.group_layers[g]
        )

    def offload_key(self, r: SimRequest, j: int, g: int) -> bytes:
        """The offload key of offloaded block ``j`` of group ``g`` (module docstring rule)."""
        hpb = self.bs * self.f // self.hbs
        return r.hashes[(j + 1) * hpb - 1] + bytes([g])

    def key_of(self, rid: str, j: int, g: int = 0) -> bytes:
        """The offload key of offloaded block ``j`` of group ``g`` of request ``rid``."""
        return self.offload_key(self.requests[rid], j, g)

    def in_flight(self, rid: str | None = None, direction: str | None = None) -> list[int]:
        """Job ids in flight (optionally of one request / direction), oldest first."""
        return sorted(
            jid
            for jid, j in self.jobs.items()
            if (rid is None or j.job.request_id == rid)
            and (direction is None or j.job.direction == direction)
        )

    # ------------------------------------------------------------------ GPU blocks
    def _alloc(self) -> int:
        b = self.free.pop()
        old = self.cached_as.pop(b, None)
        if old is not None:
            del self.cache[old]
        self.gen[b] += 1
        self.refcnt[b] = 1
        return b

    def _release(self, b: int) -> None:
        if b == 0:
            return
        self.refcnt[b] -= 1
        if self.refcnt[b] < 0:
            self.fail(f"block {b} freed twice")
        if self.refcnt[b] == 0:
            self.free.append(b)

    def _free_all(self, r: SimRequest) -> None:
        for g, table in enumerate(r.table):
            for b in table:  # head first: LIFO reuses the tail first, the head last
                self._release(b)
            r.table[g] = []
            r.gens[g] = []

    def _skip_blocks(self, g: int, tokens: int) -> int:
        """Leading positions group g does not keep once ``tokens`` tokens are computed."""
        desc = self.groups[g]
        if desc.kind == "sliding_window":
            return max(0, tokens - desc.sliding_window + 1) // self.bs
        if desc.kind == "mamba":
            return max(0, tokens // self.bs - 1)
        return 0

    def _free_skipped(self, r: SimRequest) -> None:
        for g, table in enumerate(r.table):
            for p in range(min(self._skip_blocks(g, r.computed), len(table))):
                if table[p] != 0:
                    self._release(table[p])
                    table[p] = 0
                    r.gens[g][p] = 0

    def _grow(self, r: SimRequest, upto: int, skip_tokens: int) -> bool:
        """Extend every group's table to ``upto`` positions (all or nothing)."""
        need = sum(
            1
            for g, table in enumerate(r.table)
            for p in range(len(table), upto)
            if p >= self._skip_blocks(g, skip_tokens)
        )
        if need > len(self.free):
            return False
        for g, table in enumerate(r.table):
            for p in range(len(table), upto):
                if p < self._skip_blocks(g, skip_tokens):
                    table.append(0)
                    r.gens[g].append(0)
                else:
                    b = self._alloc()
                    table.append(b)
                    r.gens[g].append(self.gen[b])
                    r.appended[g].append(b)
        return True

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        rid: str,
        prompt: Sequence[int],
        max_tokens: int = 1,
        *,
        output: Sequence[int] | None = None,
        chunk: int | None = None,
    ) -> SimRequest:
        """Queue a new request (admitted at the next step)."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} exists")
        if output is None:
            output = [
                100_000 + int.from_bytes(_h(rid.encode(), str(i).encode())[:2], "little")
                for i in range(max_tokens)
            ]
        tokens = list(prompt) + list(output)[:max_tokens]
        r = SimRequest(rid, tokens, len(prompt), max_tokens, chunk, Request(rid, [], 0))
        r.table = [[] for _ in self.groups]
        r.gens = [[] for _ in self.groups]
        r.appended = [[] for _ in self.groups]
        prev = b"root"
        for p in range(-(-len(tokens) // self.bs)):
            prev = _h(prev, _tok_bytes(tokens[p * self.bs : (p + 1) * self.bs]))
            r.cids.append(prev)
        prev = b"root"
        for i in range(len(tokens) // self.hbs):
            prev = _h(prev, _tok_bytes(tokens[i * self.hbs : (i + 1) * self.hbs]))
            r.hashes.append(prev)
        self.requests[rid] = r
        self.order.append(rid)
        self._publish(r, len(prompt))
        return r

    def _publish(self, r: SimRequest, known: int) -> None:
        r.known = known
        r.req.num_tokens = known
        r.req.block_hashes = list(r.hashes[: known // self.hbs])

    def preempt(self, rid: str) -> None:
        """Preempt a running request (or one whose load finished but that was never scheduled):
        free its blocks now; it is looked up again and resumed later."""
        r = self.requests[rid]
        if r.status not in ("running", "loaded"):
            raise ValueError(f"{rid} is {r.status}, not running")
        self._free_all(r)
        r.status = "waiting"
        r.computed = 0
        r.resumed = True
        r.scheduled_before = False
        self._preempted_ids.append(rid)
        self.order.remove(rid)
        self.order.append(rid)
        self._scheduled = [s for s in self._scheduled if s.request_id != rid]

    def abort(self, rid: str) -> bool:
        """Abort a request (queued or running) through ``request_finished``."""
        r = self.requests[rid]
        in_flight = self.sched.request_finished(r.req)
        self._finish(r, in_flight)
        return in_flight

    def _finish(self, r: SimRequest, in_flight: bool) -> None:
        self._finished_ids.append(r.rid)
        if r.rid in self.order:
            self.order.remove(r.rid)
        self._scheduled = [s for s in self._scheduled if s.request_id != r.rid]
        if in_flight and not self.free_early:
            r.status = "kept"
            # store batching: True with nothing in flight means the next step stores its
            # waiting blocks (or lists it in finished_storing when none can be stored)
            r.flush_due = not self.in_flight(r.rid)
        else:
            self._free_all(r)
            r.status = "done"

    # ------------------------------------------------------------------ one step
    def step(self) -> StepRecord:
        """One engine step: :meth:`begin_step` then :meth:`end_step`."""
        self.begin_step()
        return self.end_step()

    def begin_step(self) -> StepRecord:
        """Scheduling: running requests get their tokens, waiting ones are looked up and
        admitted (load jobs prepared by update_state_after_alloc)."""
        self.step_no += 1
        self.rec = StepRecord(self.step_no)
        self._scheduled = []
        for r in self.requests.values():
            r.appended = [[] for _ in self.groups]
        preempted_before = len(self._preempted_ids)
        for rid in list(self.order):
            r = self.requests[rid]
            if r.status != "running" or rid not in self.order:
                continue
            self._free_skipped(r)
            n = self._tokens_this_step(r)
            while not self._grow(r, -(-(r.computed + n) // self.bs), r.computed):
                victim = next(
                    self.requests[v] for v in reversed(self.order)
                    if self.requests[v].status == "running"
                )  # fmt: skip
                self.preempt(victim.rid)
                if victim is r:
                    break
            else:
                self._schedule(r, n)
        if len(self._preempted_ids) > preempted_before:
            return self.rec  # no admissions in a step that had to preempt
        for rid in list(self.order):
            r = self.requests[rid]
            if r.status == "loaded":
                n = self._tokens_this_step(r)
                if not self._grow(r, -(-(r.computed + n) // self.bs), r.computed):
                    break
                self._schedule(r, n)
            elif r.status == "waiting" and not self._admit(r):
                break
        if not self._scheduled and not any(x.status == "running" for x in self.requests.values()):
            # Out of blocks with nothing running: loaded requests hold blocks but cannot grow
            # (or a waiting one cannot be admitted). Like an engine, preempt the newest loaded
            # request so that the others can go on.
            loaded = [v for v in self.order if self.requests[v].status == "loaded"]
            if loaded:
                self.preempt(loaded[-1])
        return self.rec

    def _tokens_this_step(self, r: SimRequest, computed: int | None = None) -> int:
        """Every known token not computed yet (prefill, recompute or one decode token),
        capped by the request's chunk."""
        c = r.computed if computed is None else computed
        left = r.prompt_len + r.generated - c
        return left if r.chunk is None else max(1, min(left, r.chunk))

    def _schedule(self, r: SimRequest, n: int) -> None:
        whole = not r.scheduled_before
        ids = r.table if whole else r.appended
        self._scheduled.append(
            ScheduledRequest(
                r.rid,
                tuple(tuple(t) for t in ids),
                num_computed_tokens=r.computed,
                num_scheduled_tokens=n,
                resumed_from_preemption=r.resumed and whole,
            )
        )
        r.scheduled_before = True
        r.resumed = False
        r.status = "running"
        r.pending_tokens = n

    def _prefix_hit(self, r: SimRequest) -> list[list[int]]:
        hits: list[list[int]] = [[] for _ in self.groups]
        if not self.gpu_prefix_cache:
            return hits
        p = 0
        while (p + 1) * self.bs <= r.known - 1:
            blocks = [self.cache.get((r.cids[p], g)) for g in range(len(self.groups))]
            if any(b is None for b in blocks):
                break
            for g, b in enumerate(blocks):
                hits[g].append(b)  # type: ignore[arg-type]
            p += 1
        return hits

    def _admit(self, r: SimRequest) -> bool:
        """Lookup + allocation of a waiting request; False when out of GPU blocks."""
        hits = self._prefix_hit(r)
        c = len(hits[0]) * self.bs
        n_ext, _ = self.sched.get_num_new_matched_tokens(r.req, c)
        assert self.rec is not None
        self.rec.lookups[r.rid] = (c, n_ext)
        if n_ext is None:
            return True  # retry later; other requests may go on
        total = c + n_ext
        n = 0 if n_ext else self._tokens_this_step(r, c)
        upto = -(-(total + n) // self.bs)
        need = sum(
            1
            for g in range(len(self.groups))
            for p in range(len(hits[g]), upto)
            if p >= self._skip_blocks(g, total)
        )
        free_after_hits = len(self.free) - sum(
            1 for g in range(len(self.groups)) for b in hits[g] if self.refcnt[b] == 0
        )
        if need > free_after_hits:
            return False
        for g in range(len(self.groups)):
            for b in hits[g]:
                if self.refcnt[b] == 0:
                    self.free.remove(b)
                self.refcnt[b] += 1
                r.table[g].append(b)
                r.gens[g].append(self.gen[b])
        r.hit = c
        ok = self._grow(r, upto, total)
        assert ok
        self.sched.update_state_after_alloc(r.req, [list(t) for t in r.table], n_ext)
        if n_ext:
            r.status = "loading"
            r.load = (c, total)
            r.computed = c
            r.load_failed = False
        else:
            r.computed = c
            self._schedule(r, n)
        return True

    def end_step(self) -> StepRecord:
        """build_connector_meta, the worker (flushes, forward pass writes, job submission),
        then (auto_complete) every in-flight job is reported; every invariant is checked."""
        rec = self.rec
        assert rec is not None
        step = SchedulerStep(
            tuple(self._scheduled), tuple(self._finished_ids), tuple(self._preempted_ids)
        )
        rec.scheduled = step.scheduled
        meta = self.sched.build_connector_meta(step)
        for s in step.scheduled:
            for ids in s.new_block_ids:
                for b in ids:
                    self.announced_gen[b] = max(self.announced_gen[b], self.gen[b])
        for job in meta.load_jobs:
            for b in job.gpu.block_ids:
                self.announced_gen[b] = max(self.announced_gen[b], self.gen[b])
        self._finished_ids = []
        self._preempted_ids = []
        for r in self.requests.values():
            if r.flush_due:
                r.flush_due = False  # its store is in flight now, or finished_storing lists it
                r.flush_built = not any(j.request_id == r.rid for j in meta.store_jobs)
        rec.meta = meta
        rec.flushed = tuple(meta.jobs_to_flush)
        self._take_events()
        new_jobs = [*meta.load_jobs, *meta.store_jobs]
        for job in new_jobs:
            if job.job_id in self.jobs or job.job_id in self.executed_ids:
                self.fail(f"job id {job.job_id} reused")
            self._check_job(job)
        for jid in meta.jobs_to_flush:
            if jid not in self.jobs:
                self.fail(f"jobs_to_flush names job {jid}, which is not in flight")
            self._execute(jid)
        # Fences: everything in flight now runs concurrently with this step's jobs and writes.
        for job in new_jobs:
            rec_job = self._track(job)
            for _g, _p, b, gen in rec_job.blocks:
                self._check_fence(b, gen, job.direction, f"{job.direction} job {job.job_id}")
            if job.direction == "load":
                self.requests[job.request_id].load_emitted = True
            target = rec.loaded if job.direction == "load" else rec.stored
            target.setdefault(job.request_id, set()).update((g, p) for g, p, _, _ in rec_job.blocks)
            self.jobs[job.job_id] = rec_job
        for s in step.scheduled:
            self._forward(self.requests[s.request_id], s)
        self._check_no_load_and_store()
        if self.async_scheduling:
            for rid, known in self._unpublished:
                r = self.requests[rid]
                if r.status not in ("done", "kept"):
                    self._publish(r, max(r.known, known))
            self._unpublished = []
        for s in step.scheduled:
            self._after_forward(self.requests[s.request_id])
        if self.auto_complete and (self.jobs or any(r.flush_built for r in self.requests.values())):
            self.complete()
        self.check()
        self.records.append(rec)
        self.rec = None
        return rec

    # ------------------------------------------------------------------ jobs
    def _positions(self, job: TransferJob) -> list[tuple[int, int, int]]:
        out = []
        off = 0
        for g, (n, start) in enumerate(
            zip(job.gpu.group_sizes, job.gpu.block_indices, strict=True)
        ):
            for i in range(n):
                out.append((g, start + i, job.gpu.block_ids[off + i]))
            off += n
        return out

    def _check_job(self, job: TransferJob) -> None:
        """Invariant 1 and the CPU side of a newly emitted job."""
        ng = len(self.groups)
        gpu = job.gpu
        if len(gpu.group_sizes) != ng or len(gpu.block_indices) != ng:
            self.fail(f"job {job.job_id}: group_sizes/block_indices not one per group: {gpu}")
        if sum(gpu.group_sizes) != len(gpu.block_ids) or not gpu.block_ids:
            self.fail(f"job {job.job_id}: sum(group_sizes) != len(block_ids) or empty: {gpu}")
        if 0 in gpu.block_ids:
            self.fail(f"job {job.job_id}: null block in {gpu.block_ids}")
        r = self.requests.get(job.request_id)
        if r is None:
            self.fail(f"job {job.job_id} of unknown request {job.request_id}")
            return
        expected_keys = []
        for g, (n, start) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            if n:
                for j in range(start // self.f, (start + n - 1) // self.f + 1):
                    expected_keys.append(self.offload_key(r, j, g))
        if list(job.keys) != expected_keys:
            self.fail(f"job {job.job_id}: keys {job.keys} != expected {expected_keys}")
        if len(job.cpu.block_ids) != len(job.keys):
            self.fail(f"job {job.job_id}: {len(job.cpu.block_ids)} CPU ids for {len(job.keys)}")
        want_state = "pending" if job.direction == "store" else "ready"
        for k, cpu in zip(job.keys, job.cpu.block_ids, strict=True):
            if self.sched.block_state(k) != want_state:
                self.fail(f"{job.direction} job {job.job_id}: key {k!r} is "
                          f"{self.sched.block_state(k)}, expected {want_state}")  # fmt: skip
            if self.sched.cpu_block_id(k) != cpu:
                self.fail(f"job {job.job_id}: CPU id {cpu} != block_id(key) "
                          f"{self.sched.cpu_block_id(k)}")  # fmt: skip
            if job.direction == "load" and self.sched.pin_count(k) < 1:
                self.fail(f"load job {job.job_id}: key {k!r} not pinned")
        if r.status in ("done", "kept") and job.direction == "load":
            self.fail(f"load job {job.job_id} emitted for finished request {r.rid}")
        if not self.check_tables:
            return
        # a finished request's computed tokens stay computed (a store due at its finish)
        done_tokens = {"running": r.computed + r.pending_tokens, "kept": r.computed,
                       "done": r.computed}.get(r.status, 0)  # fmt: skip
        for g, p, b in self._positions(job):
            if p >= len(r.table[g]):
                self.fail(f"job {job.job_id}: position {p} of group {g} beyond the table")
            if job.direction == "load":
                if r.table[g][p] != b:
                    self.fail(f"load job {job.job_id}: group {g} position {p} block {b} but the "
                              f"table has {r.table[g][p]}")  # fmt: skip
                lo, hi = r.load or (0, 0)
                if not lo // self.bs <= p < hi // self.bs:
                    self.fail(f"load job {job.job_id}: position {p} outside the hit {r.load}")
            else:
                # the block must still be the one the request got at p (not reallocated)
                held = r.table[g][p] == b and r.gens[g][p] == self.gen[b]
                freed_intact = r.table[g][p] == 0 and self._was_at(r, g, p, b)
                if not (held or freed_intact):
                    self.fail(f"store job {job.job_id}: group {g} position {p} reads block {b} "
                              f"(table has {r.table[g][p]}): stale block id")  # fmt: skip
                if (p + 1) * self.bs > done_tokens:
                    self.fail(f"store job {job.job_id}: position {p} is not fully computed "
                              f"({done_tokens} tokens)")  # fmt: skip

    def _was_at(self, r: SimRequest, g: int, p: int, b: int) -> bool:
        """Block ``b`` was at position ``p`` and no newer allocation of it was announced to
        the scheduler (a newer one not announced yet has not written the block either; when it
        writes, the fence check sees it)."""
        was = r.history.get((g, p))
        return was is not None and was[0] == b and self.announced_gen[b] <= was[1]

    def _track(self, job: TransferJob) -> JobRec:
        blocks = [(g, p, b, self.gen[b]) for g, p, b in self._positions(job)]
        if job.direction == "load":
            r = self.requests[job.request_id]
            blocks = [(g, p, b, r.gens[g][p]) for g, p, b, _ in blocks]
        return JobRec(job, self.step_no, blocks)

    def _check_fence(self, b: int, gen: int, direction: str, what: str) -> None:
        """A write (or a new job) on block ``b`` of allocation ``gen`` while an in-flight,
        unexecuted job of another allocation touches it (and is not ordered before it by its
        stream) is a missing fence."""
        for jid, j in self.jobs.items():
            if j.executed:
                continue
            if direction != "compute" and j.job.direction == direction:
                continue  # FIFO within a direction
            for _, _, b2, gen2 in j.blocks:
                if b2 == b and gen2 != gen:
                    self.fail(f"fence: {what} touches block {b} (allocation {gen}) while "
                              f"{j.job.direction} job {jid} of allocation {gen2} is in flight "
                              "and was not flushed")  # fmt: skip

    def _execute(self, jid: int) -> None:
        """Move a job's bytes (and, FIFO, those of older unexecuted jobs of its direction)."""
        job = self.jobs[jid]
        if job.executed:
            return
        for older in sorted(self.jobs):
            o = self.jobs[older]
            if older < jid and not o.executed and o.job.direction == job.job.direction:
                self._execute(older)
        r = self.requests[job.job.request_id]
        if job.job.direction == "store":
            for g, p, b, gen in job.blocks:
                if self.gen[b] == gen and not self.block_matches(b, g, r.cids[p]):
                    self.fail(f"store job {jid}: block {b} (group {g}, position {p}) does not "
                              "hold that position's bytes: a wrong copy")  # fmt: skip
        ok = self.worker.transfer_async(jid, job.job.src, job.job.dst)
        (res,) = self.worker.wait([jid])
        if not ok or not res.success:
            self.fail(f"worker failed job {jid}: {res.error}")
        job.executed = True
        if job.job.direction == "load":
            for g, p, b, gen in job.blocks:
                if self.written_gen[b] > gen:
                    self.fail(f"load job {jid} clobbered block {b}, now owned by allocation "
                              f"{self.written_gen[b]}")  # fmt: skip
                self.written_gen[b] = max(self.written_gen[b], gen)
                if self.gen[b] == gen and not self.block_matches(b, g, r.cids[p]):
                    self.fail(f"load job {jid}: block {b} (group {g}, position {p}) of {r.rid} "
                              "does not hold the bytes computed for that prefix")  # fmt: skip

    # ------------------------------------------------------------------ forward pass
    def _forward(self, r: SimRequest, s: ScheduledRequest) -> None:
        c, n = s.num_computed_tokens, s.num_scheduled_tokens
        # every block the request holds for computed tokens must be intact
        for g, table in enumerate(r.table):
            for p in range(min(len(table), -(-c // self.bs))):
                b = table[p]
                if b and not self.block_matches(b, g, r.cids[p]):
                    self.fail(f"request {r.rid}: block {b} (group {g}, position {p}) was "
                              "corrupted before it was used")  # fmt: skip
        hist = r.history
        for p in range(c // self.bs, -(-(c + n) // self.bs)):
            for g, table in enumerate(r.table):
                b = table[p]
                if b == 0:
                    continue
                self._check_fence(b, self.gen[b], "compute", f"the forward pass of {r.rid}")
                for name in self.group_layers[g]:
                    self.rows[name][b].copy_(self.pattern(r.cids[p], g, name))
                self.written_gen[b] = self.gen[b]
                hist[(g, p)] = (b, self.gen[b])

    def _after_forward(self, r: SimRequest) -> None:
        n = r.pending_tokens
        r.pending_tokens = 0
        r.computed += n
        if self.gpu_prefix_cache:
            for p in range(r.computed // self.bs):
                for g in range(len(self.groups)):
                    b = r.table[g][p]
                    key = (r.cids[p], g)
                    if b and key not in self.cache and b not in self.cached_as:
                        self.cache[key] = b
                        self.cached_as[b] = key
        if r.computed == r.prompt_len + r.generated:
            r.generated += 1
            known = r.prompt_len + r.generated
            if self.async_scheduling:
                self._unpublished.append((r.rid, known))
            else:
                self._publish(r, known)
            if r.generated >= r.max_tokens:
                in_flight = self.sched.request_finished(r.req)
                self._finish(r, in_flight)

    # ------------------------------------------------------------------ reports
    def complete(
        self,
        job_ids: Iterable[int] | None = None,
        *,
        ranks: Iterable[int] | None = None,
        fail_ranks: Iterable[int] = (),
    ) -> ConnectorOutput:
        """Execute (if needed) and report jobs: ``ranks`` (default: every rank that has not
        reported yet) each report once, failing when in ``fail_ranks``."""
        ids = self.in_flight() if job_ids is None else list(job_ids)
        fail = set(fail_ranks)
        reports: list[tuple[int, int, bool]] = []
        for jid in ids:
            if jid in self.jobs:
                self._execute(jid)
                todo = (
                    [k for k in range(self.world_size) if k not in self.jobs[jid].ranks]
                    if ranks is None
                    else list(ranks)
                )
            else:
                todo = [0] if ranks is None else list(ranks)
            reports.extend((jid, k, k not in fail) for k in todo)
        return self.deliver(reports)

    def deliver(self, reports: Sequence[tuple[int, int, bool]]) -> ConnectorOutput:
        """update_connector_output with ``(job_id, rank, success)`` reports; checks what it
        concluded against the simulator's own bookkeeping and acts on it like an engine."""
        out = self.sched.update_connector_output([(j, s) for j, _, s in reports])
        expect_done: list[int] = []
        for jid, rank, ok in reports:
            j = self.jobs[jid]
            j.ranks.add(rank)
            j.failed = j.failed or not ok
            if len(j.ranks) == self.world_size:
                expect_done.append(jid)
        if sorted(out.completed_jobs) != sorted(expect_done):
            self.fail(f"completed_jobs {out.completed_jobs} != expected {expect_done}")
        if sorted(out.failed_jobs) != sorted(j for j in expect_done if self.jobs[j].failed):
            self.fail(f"failed_jobs {out.failed_jobs} wrong")
        done = {jid: self.jobs.pop(jid) for jid in expect_done}
        self.executed_ids.update(done)
        self._take_events()
        for jid, j in done.items():
            for k in j.job.keys:
                state = self.sched.block_state(k)
                if j.job.direction == "store":
                    want = "missing" if j.failed or j.stale else "ready"
                    if state != want:
                        self.fail(f"store job {jid} completed (failed={j.failed}) but key "
                                  f"{k!r} is {state}")  # fmt: skip
        # loads
        for j in done.values():
            if j.job.direction != "load":
                continue
            r = self.requests[j.job.request_id]
            r.load_failed = r.load_failed or j.failed
        for rid in set(out.finished_loading) | set(out.failed_loading):
            r = self.requests[rid]
            if self.in_flight(rid, "load"):
                self.fail(f"{rid} reported loaded while its loads are in flight")
            if r.status != "loading" or r.load is None:
                self.fail(f"{rid} reported loaded but it was {r.status}")
            failed = rid in out.failed_loading
            if failed != r.load_failed:
                self.fail(f"{rid}: failed_loading={failed} but a rank failed={r.load_failed}")
            lo, hi = r.load  # type: ignore[misc]
            if failed:
                r.computed = lo
            else:
                r.computed = min(hi, r.prompt_len + r.generated - 1)
            r.status = "loaded"
            r.load = None
            r.load_emitted = False
        for r in self.requests.values():
            if r.status == "loading" and r.load_emitted and not self.in_flight(r.rid, "load"):
                self.fail(f"{r.rid}: its loads completed but it is not in finished_loading")
        for rid in out.finished_storing:
            r = self.requests[rid]
            if r.status == "done" and self.free_early:
                continue  # freed at once already
            if r.status != "kept":
                self.fail(f"finished_storing names {rid}, which is {r.status}")
            r.flush_built = False
            self._free_all(r)
            r.status = "done"
        for r in self.requests.values():
            if r.flush_built:
                self.fail(f"{r.rid}: the store due at its finish stored nothing, but "
                          "finished_storing did not list it")  # fmt: skip
        if self.rec is not None:
            self.rec.outputs.append(out)
        self.check()
        return out

    def reset_cache(self) -> int:
        """The scheduler's reset_cache: the jobs in flight become stale (a store of theirs
        completes without making its blocks hits)."""
        for j in self.jobs.values():
            j.stale = True
        n = self.sched.reset_cache()
        self._take_events()
        self.check()
        return n

    def _take_events(self) -> None:
        for ev in self.sched.take_events():
            if self.rec is not None:
                self.rec.events.append(ev)
            keys = set(ev.keys)
            if ev.removed:
                if not keys <= self.ready_keys:
                    self.fail(f"BlockRemoved for keys that were not stored: {keys}")
                self.ready_keys -= keys
            else:
                self.ready_keys |= keys

    # ------------------------------------------------------------------ invariants
    def _check_no_load_and_store(self) -> None:
        per: dict[str, set[str]] = {}
        for j in self.jobs.values():
            per.setdefault(j.job.request_id, set()).add(j.job.direction)
        for rid, dirs in per.items():
            if dirs == {"load", "store"}:
                self.fail(f"request {rid} has a load and a store in flight at once")

    def check(self) -> None:
        """Invariants that hold between any two hook calls."""
        st = self.sched.stats()
        if self.sched.node_pool is not None:
            # the pool's counts cover every engine on it (its own tests check them)
            st = {**st, "num_cpu_blocks": 0, "num_free_blocks": 0, "num_stored_blocks": 0,
                  "num_pending_blocks": 0, "num_retired_blocks": 0}  # fmt: skip
        if (
            st["num_free_blocks"]
            + st["num_stored_blocks"]
            + st["num_pending_blocks"]
            + st["num_retired_blocks"]
            != st["num_cpu_blocks"]
        ):
            self.fail(f"CPU pool accounting broken: {st}")
        pending = {k for j in self.jobs.values() if j.job.direction == "store" for k in j.job.keys}
        if self.sched.tiers is not None:  # blocks being promoted from a secondary tier
            pending |= self.sched.tiers.promoting_keys()
        if self.sched.node_pool is None and st["num_pending_blocks"] != len(pending):
            self.fail(f"{st['num_pending_blocks']} pending CPU blocks but {len(pending)} keys in "
                      "in-flight stores")  # fmt: skip
        if st["num_jobs_in_flight"] != len(self.jobs):
            self.fail(f"scheduler has {st['num_jobs_in_flight']} jobs in flight, engine "
                      f"{len(self.jobs)}")  # fmt: skip
        if self.enable_events:
            if self.sched.node_pool is None and st["num_stored_blocks"] != len(self.ready_keys):
                self.fail(f"{st['num_stored_blocks']} stored blocks but events say "
                          f"{len(self.ready_keys)}")  # fmt: skip
            for k in self.ready_keys:
                if self.sched.block_state(k) != "ready":
                    self.fail(f"key {k!r} stored per events is {self.sched.block_state(k)}")
        loading: dict[bytes, int] = {}
        for j in self.jobs.values():
            if j.job.direction == "load":
                for k in j.job.keys:
                    loading[k] = loading.get(k, 0) + 1
        for k, n in loading.items():
            if self.sched.block_state(k) != "ready" or self.sched.pin_count(k) < n:
                self.fail(f"key {k!r} of {n} in-flight loads is {self.sched.block_state(k)} "
                          f"with pin count {self.sched.pin_count(k)}")  # fmt: skip
        self._check_no_load_and_store()
        for r in self.requests.values():
            if (
                r.status == "kept"
                and not self.in_flight(r.rid)
                and not (r.flush_due or r.flush_built)
            ):
                self.fail(f"{r.rid} keeps its GPU blocks (request_finished returned True) but "
                          "has no job in flight and was not in finished_storing: the blocks "
                          "would never be freed")  # fmt: skip
        # GPU block accounting
        held = [0] * self.num_gpu_blocks
        for r in self.requests.values():
            for t in r.table:
                for b in t:
                    if b:
                        held[b] += 1
        for b in range(1, self.num_gpu_blocks):
            if held[b] != self.refcnt[b]:
                self.fail(f"GPU block {b}: refcount {self.refcnt[b]} but held {held[b]} times")
        if len(self.free) != len(set(self.free)) or sum(
            1 for b in range(1, self.num_gpu_blocks) if self.refcnt[b] == 0
        ) != len(self.free):
            self.fail("GPU free list inconsistent")

    def drain(self, max_steps: int = 200) -> None:
        """Step until no request is live and no job is in flight."""
        for i in range(max_steps):
            live = [r for r in self.requests.values() if r.status not in ("done",)]
            if not live and not self.jobs:
                return
            if i == max_steps // 2:
                # A tiny GPU pool can leave requests that never fit (the simulator's scheduling
                # policy is simple): abort what is still queued, which must drain as well.
                for r in live:
                    if r.status in ("waiting", "loading", "loaded", "running"):
                        self.abort(r.rid)
            self.step()
            if not self.auto_complete and self.jobs:
                self.complete()
        states = [
            (r.rid, r.status, r.prompt_len, sum(len(t) for t in r.table))
            for r in self.requests.values()
            if r.status != "done"
        ]
        raise HarnessViolation(
            f"not drained after {max_steps} steps: {states}, {len(self.free)} free GPU blocks "
            f"of {self.num_gpu_blocks - 1}, lookups of the last step {self.records[-1].lookups}"
        )
