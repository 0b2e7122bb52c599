"""The tools on a real vLLM: ``kvoff replay --engine vllm`` (small) and ``kvoff bench scheduler
--vs-vllm`` (small shapes). Their numbers are benchmarks; these tests check what they report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Without vLLM every test here skips with the reason (tests/integrations/conftest.py).


def test_replay_engine_vllm_accounts_exactly_and_outputs_match(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvoff", "replay", "--engine", "vllm", "--limit", "24",
         "--concurrency", "4", "--max-tokens", "4", "--no-progress",
         "--json", str(out)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())["result"]
    assert set(result["runs"]) == {"kvoff", "engine_only"}
    for run in result["runs"].values():
        assert run["accounting_exact"]
        hits = sum(run["hit_tokens"].values())
        assert run["prefill_tokens_computed"] == run["input_tokens"] - hits
    assert result["outputs_equal"] is True
    assert result["runs"]["engine_only"]["hit_tokens"]["kvoff"] == 0
    assert "TTFT p50" in proc.stdout


def test_replay_engine_vllm_rejects_simulator_flags() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvoff", "replay", "--engine", "vllm", "--gpu-layout",
         "block_contiguous"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--gpu-layout applies to --engine sim only" in proc.stderr


def test_replay_engine_vllm_with_a_disk_tier_below_a_tiny_cpu_pool(tmp_path: Path) -> None:
    """The first reuses of the conversation trace come at requests 133-137; a 2 MiB CPU pool
    (16 blocks of the tiny model) has lost them by then, the disk tier below it has not."""
    out = tmp_path / "replay.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvoff", "replay", "--engine", "vllm", "--limit", "140",
         "--concurrency", "4", "--max-tokens", "2", "--runs", "kvoff", "--cpu-bytes", "2MiB",
         "--disk-path", str(tmp_path / "disk"), "--disk-bytes", "256MiB", "--no-progress",
         "--json", str(out)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.loads(out.read_text())["result"]["runs"]["kvoff"]
    disk = run["tiers"]["tiers"]["disk"]
    assert run["accounting_exact"] and run["hit_tokens"]["kvoff"] > 0
    assert disk["promoted_blocks"] > 0 and disk["written_blocks"] > 0
    assert disk["corrupted_blocks"] == 0
    assert "kvoff disk tier:" in proc.stdout


def test_bench_vs_vllm_same_schedule_and_both_measured() -> None:
    from dataclasses import replace

    from kvoff.tools.bench_vllm import (
        VsVllmParams,
        _drive,
        bench_manager_vs_vllm,
        bench_steps_vs_vllm,
    )

    # store_batch_blocks=1: kvoff stores every block as it fills, as vLLM's connector does.
    # With the default (4) vLLM keeps a finished request's last blocks one step longer for
    # their store (delay_free), and at this small scale that moves the engine's own prefix hits
    # and so the schedule; the runs at 256 running report same_schedule for it (docs/benchmarks.md).
    p = VsVllmParams(running=(32,), prompt_tokens=256, output_tokens=16, steps=64, rounds=2,
                     manager_blocks=2048, manager_rounds=20, store_batch_blocks=1)  # fmt: skip
    (entry,) = bench_steps_vs_vllm(p)
    assert entry["same_schedule"] is True  # every round of the three connectors
    confs = entry["configurations"]
    assert set(confs) == {"kvoff", "vllm_cpu_spec", "vllm_offloading", "none"}
    kv = confs["kvoff"]
    assert kv["connector_us"] in kv["connector_us_rounds"]  # a measured round, the median one
    assert kv["hit_tokens"]["connector"] > 0  # the stream makes the connectors load
    for name, prefix in (("vllm_offloading", "vllm"), ("vllm_cpu_spec", "vllm_cpu_spec")):
        vl = confs[name]
        assert len(kv["connector_us_rounds"]) == len(vl["connector_us_rounds"]) == 2
        # two rounds: the ratio of the medians (means of two) lies between the rounds' ratios
        ratios = entry[f"{prefix}_vs_kvoff_rounds"]
        assert len(ratios) == 2
        assert min(ratios) * 0.9999 <= entry[f"{prefix}_vs_kvoff"] <= max(ratios) * 1.0001
        assert kv["hit_tokens"]["connector"] == vl["hit_tokens"]["connector"]
        assert kv["connector_us"] > 0 and vl["connector_us"] > 0
    # vLLM as shipped runs its own manager; the other two run kvoff's
    assert confs["vllm_cpu_spec"]["manager"].startswith("vllm.v1.kv_offload.cpu.manager.")
    assert confs["vllm_offloading"]["manager"].startswith("kvoff.")
    assert kv["manager"].startswith("kvoff.") and kv["kvoff_stats"]["store_jobs"] > 0
    # with the blocks decode fills stored too (offload_prompt_only off), the default store
    # batching makes fewer store jobs on the same stream, and loads are still served
    decode = replace(p, offload_prompt_only=False)
    every = _drive("kvoff", 32, decode)
    batched = _drive("kvoff", 32, replace(decode, store_batch_blocks=None))
    assert batched["hit_tokens"]["connector"] > 0
    assert every["kvoff_stats"]["store_jobs"] > kv["kvoff_stats"]["store_jobs"]  # decode's too
    assert 0 < batched["kvoff_stats"]["store_jobs"] < every["kvoff_stats"]["store_jobs"]
    assert batched["kvoff_stats"]["stale_blocks_skipped"] == 0
    manager = bench_manager_vs_vllm(p)
    assert manager["kvoff"]["key_ops_per_s"] > 0 and manager["vllm"]["key_ops_per_s"] > 0


def test_bench_vs_vllm_node_pool_schedules_the_same_through_a_pool_process() -> None:
    """``--node-pool``: KvoffOffloadingSpec and KvoffConnector on a node pool (a pool process
    per run) find the same hits and schedule the same tokens as on a private pool, and the
    look-ahead and the leases spare the spec round trips (the ratios are a benchmark)."""
    from kvoff.tools.bench_vllm import (
        KVOFF_NODE_POOL,
        NODE_POOL,
        VsVllmParams,
        bench_steps_vs_vllm,
    )

    p = VsVllmParams(running=(32,), prompt_tokens=256, output_tokens=16, steps=32, rounds=1,
                     store_batch_blocks=1, node_pool=True)  # fmt: skip
    (entry,) = bench_steps_vs_vllm(p)
    assert entry["same_schedule"] is True
    private, pooled = entry["configurations"]["vllm_offloading"], entry["configurations"][NODE_POOL]
    assert pooled["hit_tokens"] == private["hit_tokens"] and pooled["hit_tokens"]["connector"] > 0
    stats = pooled["kvoff_stats"]
    assert stats["misses_while_detached"] == 0 and stats["async_errors"] == 0
    assert stats["answered_ahead"] > stats["round_trips"] / 4  # most look-ups asked nothing
    assert entry["node_pool_vs_private"] > 0 and len(entry["node_pool_vs_private_rounds"]) == 1
    kvoff, kvoff_pooled = (entry["configurations"][c] for c in ("kvoff", KVOFF_NODE_POOL))
    assert kvoff_pooled["hit_tokens"] == kvoff["hit_tokens"]
    assert kvoff_pooled["hit_tokens"]["connector"] > 0
    stats = kvoff_pooled["kvoff_stats"]
    assert stats["misses_while_detached"] == 0 and stats["async_errors"] == 0
    assert stats["blocks_loaded"] > 0 and stats["store_refusals"] == 0
    assert entry["kvoff_node_pool_vs_private"] > 0
