"""``kvoff replay --engines N --node-pool`` and ``kvoff pool serve|status|stop``, as users run
them: real processes, real shared memory, every loaded block checked byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvoff.node_pool import wait_for_pool
from kvoff.tools.replay import ReplayConfig, run_replay
from kvoff.tools.traces import load_trace


def _kvoff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvoff", *args], capture_output=True, text=True, check=False
    )


def test_engines_in_processes_on_a_node_pool_hit_as_one_engine_on_that_pool(
    tmp_path: Path,
) -> None:
    out = tmp_path / "np.json"
    proc = _kvoff("replay", "--engines", "3", "--node-pool", "--limit", "150", "--cpu-blocks",
                  "1500", "--no-progress", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    total, engines = doc["result"], doc["engines"]
    one = run_replay(ReplayConfig(limit=150, cpu_blocks=1500))
    assert one.hit_rate > 0.03
    # in trace order, each store done before the turn passes: the same hits, to the token
    assert total["hit_tokens"] == one.hit_tokens and total["hit_rate"] == one.hit_rate
    assert [e["requests"] for e in engines] == [50, 50, 50]
    assert all(e["blocks_loaded"] > 0 for e in engines)  # every engine loads others' blocks
    assert total["corrupted_blocks"] == 0 and total["failed_transfers"] == 0
    assert total["blocks_verified"] == total["blocks_loaded"] == one.blocks_loaded
    assert doc["pool"]["num_slots"] == 1500 and doc["pool"]["evictions"] == one.evictions
    assert "on 3 engine processes sharing one node pool" in proc.stdout


def test_engines_that_reserve_slots_hit_as_one_engine_with_every_byte_checked(
    tmp_path: Path,
) -> None:
    """``--node-pool-reserve``: the engines store into slots the pool reserved for them. With
    room to spare (no eviction), the hits are one engine's to the token, and every block
    loaded from a reserved slot's store has its bytes."""
    out = tmp_path / "np.json"
    proc = _kvoff("replay", "--engines", "3", "--node-pool", "--node-pool-reserve", "--limit",
                  "150", "--cpu-blocks", "6000", "--no-progress", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    total = doc["result"]
    one = run_replay(ReplayConfig(limit=150, cpu_blocks=6000))
    assert one.evictions == 0 and doc["pool"]["evictions"] == 0
    assert total["hit_tokens"] == one.hit_tokens and total["corrupted_blocks"] == 0
    assert total["blocks_verified"] == total["blocks_loaded"] == one.blocks_loaded > 0
    assert doc["pool"]["reserved_stores"] > 0  # the stores went into reserved slots


def test_a_pool_outlives_its_engines(tmp_path: Path) -> None:
    """Served by ``kvoff pool serve``: a second replay (engines restarted) hits the blocks the
    first stored at once; status counts; ``kvoff pool stop`` removes the socket and region."""
    sock = str(tmp_path / "pool.sock")
    region = f"kvoff-test-np-cli-{os.getpid()}"
    from kvoff.tools.replay import replay_cpu_blocks

    slots, slot_bytes = replay_cpu_blocks(ReplayConfig(cpu_blocks=1000))
    server = subprocess.Popen(
        [sys.executable, "-m", "kvoff", "pool", "serve", "--socket", sock, "--slots",
         str(slots), "--slot-bytes", str(slot_bytes), "--region", region],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_pool(sock, server)
        first = _kvoff("replay", "--engines", "2", "--node-pool", sock, "--limit", "40",
                       "--no-progress", "--json", str(tmp_path / "a.json"))  # fmt: skip
        again = _kvoff("replay", "--engines", "2", "--node-pool", sock, "--limit", "40",
                       "--no-progress", "--json", str(tmp_path / "b.json"))  # fmt: skip
        assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr
        a = json.loads((tmp_path / "a.json").read_text())["result"]
        b = json.loads((tmp_path / "b.json").read_text())["result"]
        assert b["corrupted_blocks"] == 0 and b["blocks_verified"] > 0
        assert b["hit_rate"] > a["hit_rate"]
        # the pool kept what the first engines stored: as one engine serving the 40 requests
        # twice on one pool of that size, to the token
        reqs = load_trace("conversation", limit=40)
        twice = run_replay(ReplayConfig(cpu_blocks=1000), requests=reqs + reqs)
        assert a["hit_tokens"] == sum(twice.per_request_cpu_hit_tokens[:40])
        assert b["hit_tokens"] == sum(twice.per_request_cpu_hit_tokens[40:])
        status = _kvoff("pool", "status", "--socket", sock, "--format", "json")
        st = json.loads(status.stdout)
        assert st["engines_seen"] >= 5 and st["engines_attached"] == 1  # the status call itself
        assert st["stored_blocks"] > 0 and st["region"] == region
        text = _kvoff("pool", "status", "--socket", sock).stdout
        assert f"{st['stored_blocks']:,} stored" in text
        # the replay's engines do not reserve; the pool says how many each may
        assert st["reserved_blocks"] == 0 and f"at most {st['reserve_max']:,} each" in text
        kf = st["key_filter_status"]
        assert kf["unknown_removals"] == 0 and kf["set_fraction"] > 0
        assert f"{kf['set_fraction']:.2%} of {kf['cells']:,} cells set" in text
        stop = _kvoff("pool", "stop", "--socket", sock)
        assert stop.returncode == 0, stop.stderr
        server.wait(timeout=10)
        assert not os.path.exists(sock) and not Path("/dev/shm", region).exists()
        assert not Path("/dev/shm", region + ".keys").exists()  # its key filter too
        gone = _kvoff("pool", "status", "--socket", sock)
        assert gone.returncode == 2 and "no node pool answers" in gone.stderr
    finally:
        server.kill()
        server.wait()
        Path("/dev/shm", region).unlink(missing_ok=True)


def test_bench_node_pool_measures_both_side_by_side() -> None:
    from kvoff.tools.bench_node_pool import run_node_pool_bench

    r = run_node_pool_bench("tiny", blocks=8, keys=4, rounds=2)
    for d in ("store", "load"):
        c = r["copy"][d]
        assert len(c["private_gbps"]) == len(c["node_pool_gbps"]) == 2
        assert min(c["private_gbps"] + c["node_pool_gbps"]) > 0 and c["node_pool_vs_private"] > 0
    calls = r["calls"]
    assert len(calls["node_pool_us_per_call"]) == 2
    # a socket round trip costs more than a function call into the manager
    assert calls["node_pool_us_per_call_median"] > calls["private_us_per_call_median"]
    assert r["slot_bytes"] == 2 * 16 * 16  # tiny: 2 layers × 16 bytes a token × 16 tokens
    misses = r["misses"]
    assert len(misses["filter_us_per_lookup"]) == len(misses["asking_us_per_lookup"]) == 2
    # the filter answered every miss without the socket, which costs more than a probe
    assert misses["answered_by_filter"] == 2 * 50
    assert misses["filter_us_per_lookup_median"] < misses["asking_us_per_lookup_median"]
