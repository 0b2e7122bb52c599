"""Store admission (``store_threshold`` / ``max_tracker_size``, vLLM's keys): the manager's
binding, the scheduler facade and the engine simulator, OffloadingConfig, and tier promotions.
The C++ rules themselves are in cpp/tests/test_store_threshold.cpp."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pydantic
import pytest
from scheduler_harness import EngineSim

from kvoff import _scheduler
from kvoff.config import OffloadingConfig
from kvoff.scheduler import COUNTER_NAMES

Manager = _scheduler.CPUOffloadingManager
PrepareStoreOutput = _scheduler.PrepareStoreOutput


def _state(m: Manager, keys: list[bytes]) -> tuple[object, ...]:
    return (
        m.num_free_blocks, m.num_stored_blocks, m.num_pending_blocks, m.stores_skipped,
        m.tracker_size, tuple(m.offer_count(k) for k in keys), tuple(k in m for k in keys),
    )  # fmt: skip


# ------------------------------------------------------------------------------ manager
def test_off_by_default() -> None:
    m = Manager(4)
    assert (m.store_threshold, m.max_tracker_size, m.stores_skipped, m.tracker_size) == (
        0, 64000, 0, 0,
    )  # fmt: skip
    out = m.prepare_store([b"a", b"b"])
    assert out is not None and out.keys_to_store == [b"a", b"b"] and out.skipped_keys == []
    assert "store_threshold" not in repr(m)
    assert m.offer_count(b"a") == 0


def test_first_offer_is_skipped_second_is_stored() -> None:
    m = Manager(4, "lru", True, store_threshold=2, max_tracker_size=3)
    assert m.lookup([b"1", b"2"]) == 0 and m.tracker_size == 0  # lookups count nothing
    out = m.prepare_store([b"1", b"2", 7])
    assert out == PrepareStoreOutput([], [], [], [b"1", b"2", (7).to_bytes(8, "little")])
    assert "skipped_keys=" in repr(out)
    assert m.stores_skipped == 3 and b"1" not in m and m.num_free_blocks == 4
    assert m.take_events() == []
    assert [m.offer_count(k) for k in (b"1", b"2", 7)] == [1, 1, 1]
    out = m.prepare_store([b"1", b"2"])
    assert out is not None and out.keys_to_store == [b"1", b"2"] and out.skipped_keys == []
    assert "skipped_keys" not in repr(out)
    m.complete_store(out.keys_to_store)
    assert m.lookup([b"1", b"2"]) == 2
    assert m.stores_skipped == 3
    assert "store_threshold=2" in repr(m)


def test_a_refused_prepare_store_changes_nothing_not_even_the_offer_counts() -> None:
    """Invariant 6, on purpose unlike vLLM: the retry of a refused store is one offer."""
    m = Manager(2, store_threshold=2, max_tracker_size=8)
    m.prepare_store([b"a", b"b"])  # first offer: skipped
    pending = m.prepare_store([b"x", b"y"], apply_threshold=False)  # no offer counted
    assert pending is not None and pending.keys_to_store == [b"x", b"y"]
    keys = [b"a", b"c", b"b"]
    before = _state(m, keys)
    for _ in range(3):  # a, b would be stored now: no room for them
        assert m.prepare_store(keys) is None
        assert _state(m, keys) == before
    m.complete_store(pending.keys_to_store)  # x, y become evictable
    out = m.prepare_store(keys)
    assert out is not None
    assert out.keys_to_store == [b"a", b"b"] and out.skipped_keys == [b"c"]
    assert sorted(out.evicted_keys) == [b"x", b"y"]
    assert [m.offer_count(k) for k in keys] == [2, 1, 2]
    assert m.stores_skipped == 3


def test_held_keys_are_never_skipped() -> None:
    m = Manager(2, store_threshold=2, max_tracker_size=2)
    for _ in range(2):
        out = m.prepare_store([b"head", b"tail"])
    assert out is not None and out.keys_to_store == [b"head", b"tail"]
    m.complete_store(out.keys_to_store)
    m.prepare_store([b"n1", b"n2"])  # the tracker forgets head and tail
    assert m.offer_count(b"tail") == 0
    skipped = m.stores_skipped
    out = m.prepare_store([b"tail"])
    assert out is not None and out.keys_to_store == [] and out.skipped_keys == []
    assert m.stores_skipped == skipped


def test_promotions_are_not_offers() -> None:
    m = Manager(4, store_threshold=3, max_tracker_size=8)
    out = m.prepare_store([b"a"], apply_threshold=False)
    assert out is not None and out.keys_to_store == [b"a"]
    assert m.tracker_size == 0 and m.stores_skipped == 0


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"store_threshold": -1}, ValueError, r"store_threshold=-1 is negative.*2\.\.1048576"),
        ({"store_threshold": 2**20 + 1}, ValueError, r"store_threshold=1048577.*2\^20"),
        ({"store_threshold": 2**70}, ValueError, r"store_threshold=1180591620717411303424 is "
         r"out of range; pass 0 \(off\) or 2\.\.2\*\*20"),
        ({"store_threshold": True}, TypeError, "store_threshold must be an int, got bool"),
        ({"store_threshold": 2.0}, TypeError, "store_threshold must be an int, got float"),
        ({"store_threshold": 2, "max_tracker_size": 0}, ValueError,
         r"max_tracker_size=0 but store_threshold=2 .* >= 1"),
        ({"max_tracker_size": -3}, ValueError, r"max_tracker_size=-3 is out of range"),
        ({"store_threshold": 2, "max_tracker_size": 2**31}, ValueError,
         "max_tracker_size=2147483648"),
        ({"max_tracker_size": "64000"}, TypeError, "max_tracker_size must be an int, got str"),
    ],
)  # fmt: skip
def test_bad_arguments_name_the_value_and_the_range(
    kwargs: dict[str, object], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        Manager(4, **kwargs)  # type: ignore[arg-type]


def test_prepare_store_output_takes_skipped_keys() -> None:
    a = PrepareStoreOutput([b"a"], [0], [], [b"s", 1])
    assert a.skipped_keys == [b"s", (1).to_bytes(8, "little")]
    assert a != PrepareStoreOutput([b"a"], [0], [])
    assert PrepareStoreOutput([b"a"], [0]).skipped_keys == []
    with pytest.raises(ValueError, match="empty"):
        PrepareStoreOutput([], [], [], [b""])


# ---------------------------------------------------------------------------- scheduler
def test_counter_names_append_stores_skipped() -> None:
    assert COUNTER_NAMES[-1] == "stores_skipped"
    assert COUNTER_NAMES[:13] == (
        "lookups", "lookup_retries", "hit_tokens", "load_jobs", "store_jobs", "blocks_loaded",
        "blocks_stored", "store_refusals", "blocks_evicted", "blocks_discarded",
        "stale_blocks_skipped", "jobs_flushed", "failed_jobs",
    )  # fmt: skip


def test_the_first_requests_blocks_are_skipped_a_second_with_the_prefix_stores_them() -> None:
    """Through the engine simulator (real bytes): the first request computes a prefix and
    stores nothing; the second computes it again and stores it; the third loads it."""
    sim = EngineSim(block_size=4, num_gpu_blocks=48, num_cpu_blocks=16, store_threshold=2)
    assert sim.sched._core.manager.store_threshold == 2
    prompt = list(range(13))  # 3 full blocks
    sim.add_request("a", prompt)
    rec = sim.step()
    assert rec.lookups == {"a": (0, 0)}
    assert rec.stored == {} and rec.meta.store_jobs == ()
    stats = sim.sched.stats()
    assert stats["stores_skipped"] == 3 and stats["store_refusals"] == 0
    assert all(sim.sched.block_state(sim.key_of("a", j)) == "missing" for j in range(3))
    sim.add_request("b", [*prompt[:12], 50, 51, 52, 53, 54])  # same 3 blocks, then one more
    rec = sim.step()
    assert rec.lookups == {"b": (0, 0)}
    assert rec.stored == {"b": {(0, 0), (0, 1), (0, 2)}}  # block 3 (first offer) skipped
    assert sim.sched.stats()["stores_skipped"] == 4
    sim.add_request("c", prompt)
    rec = sim.step()
    assert rec.lookups == {"c": (0, 12)}
    assert rec.loaded == {"c": {(0, 0), (0, 1), (0, 2)}}
    stats = sim.sched.stats()
    assert sim.sched.counters() == tuple(stats[n] for n in COUNTER_NAMES)
    sim.drain()


def test_scheduler_checks_the_new_arguments() -> None:
    spec = EngineSim(num_cpu_blocks=4).spec
    from kvoff.scheduler import OffloadingScheduler

    for kwargs, match in (
        ({"store_threshold": -1}, r"store_threshold=-1 must be an int in \[0, 2\*\*20\]"),
        ({"store_threshold": True}, "store_threshold=True"),
        ({"store_threshold": 2**20 + 1}, "store_threshold=1048577"),
        ({"store_threshold": 2, "max_tracker_size": 0}, r"max_tracker_size=0 must be"),
        ({"max_tracker_size": 2**31}, r"max_tracker_size=2147483648"),
    ):
        with pytest.raises(ValueError, match=match):
            OffloadingScheduler(spec, **kwargs)  # type: ignore[arg-type]
    s = OffloadingScheduler(spec, store_threshold=3, max_tracker_size=10)
    assert (s._core.manager.store_threshold, s._core.manager.max_tracker_size) == (3, 10)
    assert s.stats()["stores_skipped"] == 0


# ------------------------------------------------------------------------------- config
def test_config_keys_are_validated_and_reach_the_scheduler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = OffloadingConfig(num_cpu_blocks=8)
    assert (cfg.store_threshold, cfg.max_tracker_size) == (0, 64000)
    cfg = OffloadingConfig.from_dict({"num_cpu_blocks": 8, "store_threshold": 2,
                                      "max_tracker_size": 100})  # fmt: skip
    assert (cfg.store_threshold, cfg.max_tracker_size) == (2, 100)
    for bad, match in (
        ({"store_threshold": -1}, "greater than or equal to 0"),
        ({"store_threshold": 2**20 + 1}, "less than or equal to 1048576"),
        ({"store_threshold": True}, "expected a number"),
        ({"max_tracker_size": 0}, "greater than 0"),
        ({"max_tracker_size": 2**31}, "less than or equal to 2147483647"),
    ):
        with pytest.raises(pydantic.ValidationError, match=match):
            OffloadingConfig(num_cpu_blocks=8, **bad)  # type: ignore[arg-type]
    monkeypatch.setenv("KVOFF_STORE_THRESHOLD", "3")
    assert OffloadingConfig.load(num_cpu_blocks=8).store_threshold == 3
    monkeypatch.delenv("KVOFF_STORE_THRESHOLD")
    assert "KVOFF_STORE_THRESHOLD" not in os.environ

    import torch

    from kvoff.kv_cache_config import get_kv_cache_config
    from kvoff.scheduler import OffloadingScheduler
    from kvoff.specs import FullAttentionSpec

    layer = FullAttentionSpec(16, 8, 128, torch.bfloat16)  # 65,536-byte page
    kv = get_kv_cache_config({f"l{i}": layer for i in range(2)}, 2**24)
    s = OffloadingScheduler.from_config(
        kv,
        OffloadingConfig(cpu_bytes_to_use="16MiB", store_threshold=2, max_tracker_size=50),
    )
    assert (s._core.manager.store_threshold, s._core.manager.max_tracker_size) == (2, 50)


# -------------------------------------------------------------------------------- tiers
def test_a_promotion_from_a_tier_is_not_filtered(tmp_path: Path) -> None:
    """A block evicted from L1 and promoted back from the disk tier is stored at once: it
    passed the filter when first stored, and a promotion counts no offer."""
    from kvoff.tiers.block_format import BlockFormat, layout_fingerprint
    from kvoff.tiers.coordinator import TieredPool
    from kvoff.tiers.disk import DiskTier

    payload = 8192
    fmt = BlockFormat(layout_fingerprint(test="store-threshold", payload=payload), payload)
    # a tracker of 2 keys: it has forgotten the first pair when the second pair is stored
    m = Manager(2, "lru", store_threshold=2, max_tracker_size=2)
    slots = np.zeros((2, payload), dtype=np.uint8)
    disk = DiskTier(tmp_path / "disk", 16 * (payload + 8192), fmt)
    pool = TieredPool(m, slots.__getitem__, [disk])
    keys = [bytes([i]) * 16 for i in range(4)]
    for i in range(0, 4, 2):  # each pair offered twice: stored the second time, written to disk
        assert m.prepare_store(keys[i : i + 2]).keys_to_store == []  # type: ignore[union-attr]
        out = m.prepare_store(keys[i : i + 2])
        assert out is not None and out.keys_to_store == keys[i : i + 2]
        for k, b in zip(out.keys_to_store, out.block_ids, strict=True):
            slots[b] = keys.index(k) + 1
        m.complete_store(out.keys_to_store)
        pool.wait()
    assert m.lookup(keys[:2]) == 0  # evicted from L1 by the second pair
    counts = [m.offer_count(k) for k in keys]
    assert counts == [0, 0, 2, 2]  # a filtered promotion would skip the first pair
    skipped = m.stores_skipped
    assert pool.lookup(keys[:2]) is None  # the disk is asked
    pool.wait_reads()
    assert pool.lookup(keys[:2]) == 2  # promoted, not skipped
    assert [m.offer_count(k) for k in keys] == counts and m.stores_skipped == skipped
    ids = m.prepare_load(keys[:2])
    assert [int(slots[b][0]) for b in ids] == [1, 2]
    m.complete_load(keys[:2])
    pool.close()


# -------------------------------------------------------------------------------- tools
def _trace(tmp_path: Path) -> str:
    """48 requests of 4 blocks: two of every three reuse one of 5 prefixes (stored on their
    second offer), the third is unique (always filtered)."""
    import json

    lines = []
    for i in range(48):
        g = (i // 3) % 5
        ids = (
            [100_000 + 10 * i + k for k in range(4)]
            if i % 3 == 2
            else [10 * g + k for k in range(4)]
        )
        lines.append(json.dumps({"timestamp": i, "input_length": 4 * 512, "output_length": 1,
                                 "hash_ids": ids}))  # fmt: skip
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_policy_specs_carry_a_store_threshold() -> None:
    from kvoff.tools.policy_sweep import parse_policies, resolve_policies, split_policy

    assert split_policy("lru") == ("lru", None)
    assert split_policy("Probation+T3") == ("probation", 3)
    assert split_policy("min+t0") == ("min", 0)
    assert parse_policies("lru, lru+t2,min") == ("lru", "lru+t2", "min")
    assert resolve_policies(["lru", "lru+t2", "probation+t1", "min"]) == (
        ("lru", "lru", 0), ("lru+t2", "lru", 2), ("probation", "probation", 1),
        ("min", "min", 0),
    )  # fmt: skip
    # the default applies to names without +tN, never to min; +t0 turns it off for that row
    assert [label for label, _, _ in resolve_policies(["lru+t0", "arc", "min"], 2)] == [
        "lru", "arc+t2", "min",
    ]  # fmt: skip
    for bad, match in (
        ("lru+2", r"lru\+tN with N in 0\.\.2\*\*20"),
        ("lru+t", r"lru\+tN"),
        ("lru+t-1", r"lru\+tN"),
        (f"lru+t{2**20 + 1}", r"lru\+tN"),
        ("min+t2", "min is the offline optimum"),
        ("fifo+t2", "unknown policy 'fifo'"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_policies(bad)
    with pytest.raises(ValueError, match="repeats"):
        parse_policies("lru+t2,lru+t2")
    with pytest.raises(ValueError, match="'lru\\+t2' twice"):
        resolve_policies(["lru", "lru+t2"], 2)


def test_manager_replay_with_a_threshold_counts_what_the_replay_counts(tmp_path: Path) -> None:
    from kvoff.tools.policy_sim import run_manager_replay
    from kvoff.tools.replay import ReplayConfig, run_replay

    config = ReplayConfig(trace=_trace(tmp_path), cpu_blocks=8, store_threshold=2)
    real = run_replay(config)
    sim = run_manager_replay(config)
    assert real.stores_filtered > 0 and real.evictions > 0
    assert (real.store_threshold, real.max_tracker_size) == (2, 64000)
    for name in ("hit_tokens", "evictions", "stores_skipped", "stores_filtered", "blocks_stored"):
        assert getattr(sim, name) == getattr(real, name), name
    plain = run_replay(dataclasses.replace(config, store_threshold=0))
    assert plain.stores_filtered == 0 and plain.blocks_stored > real.blocks_stored
    with pytest.raises(ValueError, match="offline optimum without an admission filter"):
        run_replay(dataclasses.replace(config, policy="min"))
    with pytest.raises(pydantic.ValidationError, match="store_threshold"):
        run_replay(dataclasses.replace(config, store_threshold=-1))


def test_a_sweep_reports_the_filter_beside_the_plain_policy(tmp_path: Path) -> None:
    from kvoff.tools.policy_sim import run_manager_sweep
    from kvoff.tools.policy_sweep import format_sweep_table, run_policy_sweep
    from kvoff.tools.replay import ReplayConfig

    base = ReplayConfig(trace=_trace(tmp_path))
    sweep = run_policy_sweep(base, [8, 64], ["lru", "lru+t2"])
    assert sweep.policies == ("lru", "lru+t2")
    point = sweep.point("lru+t2", 8)
    assert point.store_threshold == 2 and point.stores_filtered > 0
    assert sweep.point("lru", 8).stores_filtered == 0
    d = sweep.to_dict()
    assert set(d["hit_rate"]) == {"lru", "lru+t2"}
    assert d["config"]["store_threshold"] is None
    assert "lru+t2" in d["gap_closed_lru_to_min"] or d["gap_closed_lru_to_min"] == {}
    assert "lru+t2" in format_sweep_table(sweep)
    sim = run_manager_sweep(dataclasses.replace(base, store_threshold=2), [8, 64], ["lru", "min"])
    assert sim.policies == ("lru+t2", "min")
    for c in (8, 64):  # the simulation and the replay agree
        assert sim.point("lru+t2", c).hit_tokens == sweep.point("lru+t2", c).hit_tokens


def test_the_cli_takes_the_threshold_and_writes_it_to_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from kvoff.tools.cli import main

    out = tmp_path / "r.json"
    trace = _trace(tmp_path)
    argv = ["replay", "--trace", trace, "--cpu-blocks", "64", "--store-threshold", "2",
            "--max-tracker-size", "500", "--no-progress", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "store_threshold 2" in text and "below store_threshold" in text
    result = json.loads(out.read_text())["result"]
    assert (result["store_threshold"], result["max_tracker_size"]) == (2, 500)
    assert result["stores_filtered"] > 0
    sweep = tmp_path / "s.json"
    argv = ["replay", "--trace", trace, "--sweep-capacity", "16", "--policies", "lru,lru+t2",
            "--no-progress", "--json", str(sweep)]  # fmt: skip
    assert main(argv) == 0
    assert set(json.loads(sweep.read_text())["sweep"]["hit_rate"]) == {"lru", "lru+t2"}
    for bad, match in (
        (["--policy", "min", "--store-threshold", "2"], "offline optimum"),
        (
            ["--engine", "vllm", "--store-threshold", "2"],
            "--store-threshold applies to --engine sim",
        ),
        (["--store-threshold", "-1"], "store-threshold"),
        (["--store-threshold", str(2**20 + 1)], "store_threshold"),
        (["--sweep-capacity", "16", "--policies", "min+t2"], "min is the offline optimum"),
    ):
        with pytest.raises(SystemExit) as info:
            main(["replay", "--limit", "3", "--no-progress", *bad])
        err = capsys.readouterr().err
        assert info.value.code == 2 and "Traceback" not in err
        assert match in err, err
