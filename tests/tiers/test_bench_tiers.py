"""``kvoff bench tiers`` on a real file system with real dd (tiny sizes: the figures are
benchmarks, so these tests check what is reported, never how fast)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvoff.tools.bench_tiered_pool import bench_promotion
from kvoff.tools.bench_tiers import bench_disk

pytestmark = pytest.mark.skipif(shutil.which("dd") is None, reason="dd is not installed")


def test_disk_passes_alternate_and_medians_are_of_the_passes(tmp_path: Path) -> None:
    r = bench_disk(tmp_path, 65536, 1 << 20, 256 << 10, io_threads=2, repeat=3)
    assert r["repeat"] == 3 and len(r["passes"]) == 3
    assert [p["dd_first"] for p in r["passes"]] == [True, False, True]
    # every pass stored and served (verified) every block
    assert all(p["stored"] == p["served"] == p["blocks"] == 16 for p in r["passes"])
    assert r["stored"] == r["served"] == 48
    for name in ("read_ratio", "write_ratio", "dd_read_gbps", "read_gbps"):
        values = sorted(p[name] for p in r["passes"])
        assert r[name] == values[1], name  # the median of three
    for p in r["passes"]:
        assert p["read_ratio"] == pytest.approx(p["read_gbps"] / p["dd_read_gbps"])
    assert list(tmp_path.iterdir()) == []  # each pass removed its folder


def test_disk_repeat_below_one_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="repeat must be >= 1, got 0"):
        bench_disk(tmp_path, 65536, 1 << 20, 256 << 10, io_threads=1, repeat=0)


def test_cli_writes_every_block_size_and_the_engine_thread(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvoff", "bench", "tiers", "--disk-path", str(tmp_path / "d"),
         "--no-remote", "--block-sizes", "64KiB", "128KiB", "--total-bytes", "1MiB",
         "--disk-repeat", "2", "--promotion-bytes", "1MiB", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["parameters"]["disk_repeat"] == 2
    assert [d["block_size"] for d in result["disk"]] == [65536, 131072]
    assert all(len(d["passes"]) == 2 for d in result["disk"])
    assert result["redis"] is None and "redis" not in result["skipped"]
    assert result["engine_thread"]["ratio"] > 0
    steps = result["scheduler_steps"]
    assert steps["ratio"] > 0 and steps["tier_stats"]["writes_queued"] > 0
    assert "scheduler decode step" in proc.stdout
    assert "medians over passes" in proc.stdout
    promo = result["promotion"]
    assert [r["block_size"] for r in promo["results"]] == [65536, 131072]
    assert [r["blocks"] for r in promo["results"]] == [16, 8]
    assert all(len(r["passes"]) == 2 for r in promo["results"])
    assert "promotion of one request from disk" in proc.stdout


def test_scheduler_steps_write_through_every_decode_store(tmp_path: Path) -> None:
    """The side-by-side step benchmark really writes through: every block stored in the timed
    decode steps of the tiered scheduler reaches the disk tier (none dropped: the step gap
    gives the writer time), and each configuration got its medians."""
    from kvoff.tools.bench_tiered_pool import bench_scheduler_steps_tiers

    r = bench_scheduler_steps_tiers(
        num_requests=32, decode_steps=32, num_cpu_blocks=4096, block_bytes=4096, repeat=2,
        disk_path=str(tmp_path),
    )  # fmt: skip
    stats = r["tier_stats"]
    assert stats["writes_queued"] == 32 * 32 // 16  # one block per request every 16 steps
    assert stats["writes_dropped_queue_full"] == 0
    assert stats["tiers"]["disk"]["written_blocks"] == stats["writes_queued"]
    assert len(r["per_repeat"]) == 2 and r["tiers_off_step_us"] > 0 and r["ratio"] > 0
    with pytest.raises(ValueError, match="step_gap_s"):
        bench_scheduler_steps_tiers(step_gap_s=-1.0)


def test_promotion_passes_alternate_and_every_pass_loads_the_written_bytes(tmp_path: Path) -> None:
    """bench_promotion checks the KV cache against the written payloads in every pass (it
    raises otherwise); here: what it reports."""
    r = bench_promotion(block_sizes=(32768,), request_bytes=256 << 10, repeat=3,
                        device="cpu", disk_path=str(tmp_path))  # fmt: skip
    assert r["parameters"]["device"] == "cpu"
    (res,) = r["results"]
    assert res["blocks"] == 8 and res["bytes"] == 8 * 32768
    # 3 rounded up to 4: as many passes read first as promote first (the order biases a pass)
    assert [p["read_first"] for p in res["passes"]] == [True, False, True, False]
    for name in ("read_s", "promote_s", "load_s", "promote_ratio", "load_ratio"):
        mid = sorted(p[name] for p in res["passes"])[1:3]
        assert res[name] == pytest.approx(sum(mid) / 2), name  # median of four
    for ratio, num in (("promote_ratio_balanced", "promote_s"), ("load_ratio_balanced", "load_s")):
        assert res[ratio] == pytest.approx(
            sum(p[num] for p in res["passes"]) / sum(p["read_s"] for p in res["passes"])
        )
    for p in res["passes"]:
        assert 0 < p["promote_s"] <= p["load_s"]  # the load comes after the promotion
        assert p["load_ratio"] == pytest.approx(p["load_s"] / p["read_s"])
    with pytest.raises(ValueError, match="multiple of 8192"):
        bench_promotion(block_sizes=(20000,), disk_path=str(tmp_path))


def test_disk_rates_count_only_what_was_stored_and_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvoff.tools import bench_tiers

    # a tier that accepts half the blocks and serves none: its rates are of those bytes only
    def half(tier: object, keys: list[bytes], block_size: int, batch: int) -> tuple:
        return len(keys) // 2, 1.0, 0, 1.0

    monkeypatch.setattr(bench_tiers, "_put_then_get", half)
    r = bench_disk(tmp_path, 65536, 1 << 20, 256 << 10, io_threads=1, repeat=1)
    assert r["write_gbps"] == pytest.approx(8 * 65536 / 1e9)
    assert r["read_gbps"] == 0.0
    assert r["failed"] == "stored 8 of 16 blocks and served 0 of them"
    text = bench_tiers.format_bench_tiers({"disk": [r]})
    assert "FAILED: disk tier, 64 KiB blocks: stored 8 of 16 blocks" in text


def test_dead_redis_is_an_error_not_fast(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("redis")
    from kvoff.tools.cli import main

    argv = ["bench", "tiers", "--remote-url", "redis://127.0.0.1:1", "--block-sizes", "64KiB"]
    disk = ["--disk-path", str(tmp_path), "--total-bytes", "1MiB", "--disk-repeat", "1"]
    with pytest.raises(SystemExit) as info:
        main([*argv, *disk, "--remote-total-bytes", "256KiB", "--lookup-batch", "4"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "redis://127.0.0.1:1 stored 0 of 4 blocks" in err and "--no-remote" in err


def test_redis_mac_gets_in_steady_state_alternate_and_report_their_quartiles(
    redis_url: str,
) -> None:
    pytest.importorskip("blake3")
    from kvoff.tools.bench_tiers import bench_redis_mac

    r = bench_redis_mac(
        redis_url, block_size=64 << 10, total_bytes=1 << 20, batch_bytes=256 << 10, rounds=1,
        steady_passes=3,
    )  # fmt: skip
    st = r["steady"]
    assert st["passes"] == 3 and len(st["per_pass"]) == 3
    # alternated: plain first in even passes, the MAC first in odd ones
    assert [next(iter(p)) for p in st["per_pass"]] == [
        "plain_get_gbps",
        "mac_get_gbps",
        "plain_get_gbps",
    ]
    ratios = sorted(p["mac_get_gbps"] / p["plain_get_gbps"] for p in st["per_pass"])
    assert st["get_ratio"] == pytest.approx(ratios[1])  # the median of three
    assert st["get_ratio_q1"] <= st["get_ratio"] <= st["get_ratio_q3"]
    assert all(v > 0 for p in st["per_pass"] for v in p.values())
    assert bench_redis_mac(redis_url, 64 << 10, 1 << 20, 256 << 10, 1, 0)["steady"] is None
