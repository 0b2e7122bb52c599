"""KvoffConnector's roles when the node pool refuses a load it had answered as a hit (the pool
went away between vLLM's look-up and its allocation): the scheduler role leaves the request
with nothing to load and names it in the step's metadata, and every worker reports its load as
failed, so that vLLM recomputes it instead of waiting for a load that never comes. The roles
run on kvoff's scheduler and worker over a real node pool; vLLM's records (its config, the
step's SchedulerOutput, a request's blocks) are given as the plain records the roles read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from node_pool_harness import SIM_SLOTS, Served, age_leases, sim_engine
from scheduler_harness import EngineSim

from kvoff.config import OffloadingConfig
from kvoff.node_pool import NodePoolClient
from kvoff.node_pool.client import LEASE_HELD_SHARE

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def _vllm_config() -> SimpleNamespace:
    return SimpleNamespace(
        kv_events_config=None,
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute"),
        parallel_config=SimpleNamespace(rank=0, world_size=1),
    )


def _step_output() -> SimpleNamespace:
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                             resumed_req_ids=set())  # fmt: skip
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={}, finished_req_ids=set(),
                           preempted_req_ids=None, kv_cache_block_copies=None)  # fmt: skip


def test_a_refused_load_is_reported_failed_by_every_worker(pool: Served) -> None:
    from kvoff.integrations.vllm.scheduler_role import KvoffConnectorScheduler
    from kvoff.integrations.vllm.worker_role import KvoffConnectorWorker
    from kvoff.worker import OffloadingWorker

    a = sim_engine(pool, "a")
    prompt = list(range(13))
    a.add_request("r", prompt)
    a.drain()  # the prompt's blocks are in the pool
    b = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=SIM_SLOTS)  # b's plan only
    config = OffloadingConfig.from_dict({"node_pool": pool.socket})
    client = NodePoolClient(pool.socket, b"sim-layout", name="b")
    role = KvoffConnectorScheduler(_vllm_config(), config, b.spec, "b", node_pool=client)
    b.add_request("r", prompt)
    req = b.requests["r"].req
    assert role.get_num_new_matched_tokens(req, 0) == (12, True)
    pool.stop()  # gone before vLLM allocates the request's blocks
    # a lease the pool may have let lapse (a fresh one loads even from a pool that is gone)
    age_leases(client, LEASE_HELD_SHARE + 0.05)
    blocks = SimpleNamespace(get_block_ids=lambda allow_none=False: ([1, 2, 3, 4],))
    role.update_state_after_alloc(req, blocks, 12)  # no error reaches vLLM
    meta = role.build_connector_meta(_step_output())
    assert meta.refused_loads == ("r",) and meta.load_jobs == ()
    assert role.build_connector_meta(_step_output()).refused_loads == ()  # named once

    worker = KvoffConnectorWorker(_vllm_config(), config, b.spec, "b",
                                  block_level_load_errors=True)  # fmt: skip
    worker._worker = OffloadingWorker.from_spec(b.spec, pin_memory=False)
    results = worker.get_transfer_results(meta)
    assert results.finished_recving == {"r"} and results.failed_recving == {"r"}
    role.shutdown()
